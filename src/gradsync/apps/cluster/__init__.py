"""The emulated cluster: network namespaces with shaped cables on one machine (``netns``), a
launcher that runs a gradsync command on every emulated node (``launch``), and a read-only HTTP
storage node (``storage``). The command is :mod:`gradsync.apps.commands.cluster`."""

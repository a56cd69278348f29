"""gradsync's version, in a module of its own so that any layer can read it without importing the
package's facade (``gradsync/__init__.py`` imports every layer)."""

VERSION = "0.1.0"

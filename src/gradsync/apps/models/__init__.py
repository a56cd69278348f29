"""Models for gradsync's own runs and benchmarks (torch.nn only, nothing downloaded).

Two tasks, each with its own models:

- ``classify``: images of shape (C, H, W) -> class logits (B, classes): ``vgg`` (communication
  heavy: ~21 M parameters, nearly all in the fully-connected head), ``vgg-small``, ``resnet``;
  and the papers' models at their real sizes (:mod:`gradsync.apps.models.paper`): ``resnet50``
  (25.6 M parameters with 1000 classes), ``resnet101`` (44.5 M), ``vgg16`` (138.4 M).
- ``lm``: token ids (B, T) -> next-token logits (B, T, vocabulary): ``lstm``, ``transformer``;
  ``bert-base`` (BERT-base with its masked-LM head, 109.5 M parameters at vocabulary 30522 and
  512 positions; built for a dataset, its attention is causal so that next-token targets are fair).

:func:`build_model` takes each constructor's own keyword arguments; :func:`build_model_for` builds
any model from a dataset description (task, input shape, number of classes or vocabulary size),
which is what ``gradsync train`` needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from gradsync.apps.models.paper import bert_base, resnet50, resnet101, vgg16
from gradsync.apps.models.text import LSTMLanguageModel, TransformerLanguageModel
from gradsync.apps.models.vision import VGG, ResNet

TASKS: tuple[str, ...] = ("classify", "lm")

_MODELS: dict[str, Callable[..., nn.Module]] = {
    "vgg": VGG,
    "vgg-small": lambda **kw: VGG(widths=(16, 32, 64), fc=512, **kw),
    "resnet": ResNet,
    "lstm": LSTMLanguageModel,
    "transformer": TransformerLanguageModel,
    "resnet50": resnet50,
    "resnet101": resnet101,
    "vgg16": vgg16,
    "bert-base": bert_base,
}

# The task each model is for, and how a dataset description (input shape without the batch
# dimension, number of classes or vocabulary size) becomes its constructor's keyword arguments.
_TASK_OF: dict[str, str] = {
    "vgg": "classify",
    "vgg-small": "classify",
    "resnet": "classify",
    "lstm": "lm",
    "transformer": "lm",
    "resnet50": "classify",
    "resnet101": "classify",
    "vgg16": "classify",
    "bert-base": "lm",
}


def _vgg_kwargs(shape: tuple[int, ...], classes: int) -> dict[str, Any]:
    return {"num_classes": classes, "in_channels": shape[0], "image_size": (shape[1], shape[2])}


def _resnet_kwargs(shape: tuple[int, ...], classes: int) -> dict[str, Any]:
    return {"num_classes": classes, "in_channels": shape[0]}


_KWARGS_FOR: dict[str, Callable[[tuple[int, ...], int], dict[str, Any]]] = {
    "vgg": _vgg_kwargs,
    "vgg-small": _vgg_kwargs,
    "resnet": _resnet_kwargs,
    "lstm": lambda shape, vocab: {"vocab_size": vocab},
    "transformer": lambda shape, vocab: {"vocab_size": vocab, "seq_len": shape[0]},
    "resnet50": _resnet_kwargs,
    "resnet101": _resnet_kwargs,
    "vgg16": _vgg_kwargs,
    # gradsync's lm task trains on next-token targets: mask the attention (BERT's own is bidirectional)
    "bert-base": lambda shape, vocab: {"vocab_size": vocab, "seq_len": shape[0], "causal": True},
}

# What input_shape must look like for each task.
_SHAPE_OF: dict[str, tuple[int, str]] = {"classify": (3, "(C, H, W)"), "lm": (1, "(seq_len,)")}


def model_names() -> list[str]:
    """Every registered model name, for all tasks, sorted."""
    return sorted(_MODELS)


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")


def models_for(task: str) -> list[str]:
    """The model names that fit ``task`` (``classify`` or ``lm``), sorted."""
    _check_task(task)
    return sorted(name for name in _MODELS if _TASK_OF[name] == task)


def build_model(name: str, **kwargs: Any) -> nn.Module:
    """A model by name (``vgg``, ``resnet50``, ``bert-base``, ...); ``kwargs`` go to its constructor."""
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; available models: {', '.join(model_names())}")
    return _MODELS[name](**kwargs)


def build_model_for(name: str, task: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Model ``name`` sized for a dataset: ``task`` ``classify`` with ``input_shape`` (C, H, W) and
    ``num_classes`` classes, or ``lm`` with ``input_shape`` (seq_len,) and ``num_classes`` the
    vocabulary size. Raises ``ValueError`` when the model does not fit the task (the message names
    ``--model`` and lists the models that do) or the shape does not fit the task.
    """
    _check_task(task)
    if _TASK_OF.get(name) != task:
        allowed = ", ".join(models_for(task))
        what = "unknown --model" if name not in _MODELS else "--model"
        hint = "" if name not in _MODELS else f" (it is a {_TASK_OF[name]!r} model)"
        raise ValueError(f"{what} {name!r} does not fit task {task!r}{hint}; models for {task}: {allowed}")
    rank, form = _SHAPE_OF[task]
    shape = tuple(int(s) for s in input_shape)
    if len(shape) != rank or min(shape) < 1:
        raise ValueError(
            f"task {task!r} needs input_shape {form} of positive sizes, got {tuple(input_shape)}"
        )
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    return _MODELS[name](**_KWARGS_FOR[name](shape, num_classes))


def parameter_count(model: nn.Module) -> int:
    """Number of trainable parameter elements; a tensor shared by two modules counts once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


__all__ = [
    "TASKS",
    "VGG",
    "LSTMLanguageModel",
    "ResNet",
    "TransformerLanguageModel",
    "bert_base",
    "build_model",
    "build_model_for",
    "model_names",
    "models_for",
    "parameter_count",
    "resnet50",
    "resnet101",
    "vgg16",
]

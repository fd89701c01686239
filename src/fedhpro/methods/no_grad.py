"""The no-grad passes over many rows (a client's features, the engines' evaluation): their batch size
(:func:`eval_batch_size`), memory layout (:func:`eval_layout`, :func:`eval_forward`) and precision (under
``amp``, the autocast local training uses: :func:`no_grad_precision`, :func:`no_grad_pass`), and
:func:`extract_features`. :data:`AUTOCAST_DTYPES` is the one table of autocast dtypes, the training loop's too."""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from fedhpro import runtime
from fedhpro.methods.parts import features_of


def eval_batch_size(device: torch.device) -> int:
    """Rows per forward pass of the no-grad passes (features, evaluation).

    A fixed choice per device, so runs stay reproducible; another batch size
    can change the last float digits (CPU kernels block small batches
    differently). On the CPU, 64 keeps a ``cnn`` batch's activations in
    cache: ~1.8x faster per sample than 1024 on one thread (bench/RESULTS.md);
    accelerators prefer large batches.
    """
    return 64 if device.type == "cpu" else 1024


def eval_layout(batch: Tensor) -> Tensor:
    """An image batch of a no-grad pass in ``channels_last`` on the CPU (other inputs as they are).

    oneDNN's NHWC convolutions are faster on the CPU (the ``cnn``'s
    3-channel first convolution 3x, its forward pass 1.5x, one thread); the
    features differ from the NCHW ones only in rounding (measured < 1e-6).
    Training keeps its own layout (the ``channels_last`` setting).
    """
    if batch.dim() == 4 and batch.device.type == "cpu":
        return batch.contiguous(memory_format=torch.channels_last)
    return batch


#: modules that failed on a channels_last batch (a user's model that ``.view()``s its activations): NCHW for them
_NCHW_ONLY: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()

#: the autocast dtype of the no-grad passes in the current context (None: float32); :func:`no_grad_precision` sets it
_NO_GRAD_AUTOCAST: contextvars.ContextVar[torch.dtype | None] = contextvars.ContextVar("no_grad_autocast",
                                                                                      default=None)
#: the autocast dtype of each :func:`fedhpro.runtime.amp_precision` (float32: none)
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def no_grad_precision(amp: str, device: torch.device) -> Iterator[None]:
    """The no-grad passes of the block (:func:`extract_features`, the engines' evaluation: :func:`no_grad_pass`)
    compute under the autocast local training uses for ``amp`` on ``device`` (:func:`fedhpro.runtime.amp_precision`:
    bfloat16, or float16 on a GPU without native bfloat16) and hand back float32 features and logits. ``amp=off``:
    float32, exactly the operations they ran before. A client's :meth:`~fedhpro.methods.base.Client.fit` and the
    engines' evaluation (:func:`fedhpro.engines.one_round.test_client`) enter it; the server's step stays float32."""
    token = _NO_GRAD_AUTOCAST.set(AUTOCAST_DTYPES.get(runtime.amp_precision(amp, device)))
    try:
        yield
    finally:
        _NO_GRAD_AUTOCAST.reset(token)


def no_grad_pass(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """What a no-grad pass over many batches runs in: the autocast of the current :func:`no_grad_precision`,
    entered once for the whole pass (autocast keeps its casts of the weights while it is entered), or nothing."""
    dtype = _NO_GRAD_AUTOCAST.get()
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def eval_forward(module: nn.Module, batch: Tensor) -> Tensor:
    """``module(batch)`` for a no-grad pass, in :func:`eval_layout` where the module accepts it; float32 when
    it ran under :func:`no_grad_pass`'s autocast (the callers' statistics stay float32).

    A module that raises on the channels_last batch (``.view`` needs
    contiguous NCHW strides) is remembered and run on the batch as given.
    """
    output = _laid_out_forward(module, batch)
    if _NO_GRAD_AUTOCAST.get() is not None and output.dtype in (torch.bfloat16, torch.float16):
        return output.float()
    return output


def _laid_out_forward(module: nn.Module, batch: Tensor) -> Tensor:
    if module not in _NCHW_ONLY:
        laid_out = eval_layout(batch)
        if laid_out is batch:
            return module(batch)
        try:
            return module(laid_out)
        except RuntimeError:
            _NCHW_ONLY[module] = True
    return module(batch)


@torch.no_grad()
def extract_features(model: nn.Module, x: Tensor, batch_size: int | None = None) -> Tensor:
    """``f(x)`` for all rows of ``x`` in eval mode (restores the previous mode); float32, computed in the current
    :func:`no_grad_precision`."""
    batch_size = batch_size or eval_batch_size(x.device)
    was_training = model.training
    model.eval()
    with no_grad_pass(x.device):
        features = torch.cat([eval_forward(features_of(model), x[i:i + batch_size])
                              for i in range(0, x.shape[0], batch_size)])
    model.train(was_training)
    return features

"""What train_fn sees of a parameter while it is traced.

The first trace of a model hands train_fn fake copies of the live parameters, which are
``nn.Parameter``\\ s to ``isinstance`` and ``Module.get_parameter`` (``FakeTensorMode.from_tensor``
marks them). Every other value that stands in for a parameter - a fake tensor of its full shape
(the live one is a shard), its ``param_dtype`` cast, its DTensor under tensor parallelism - is
marked the same way, so that every traced graph sees the model as the first did, and as eager
FSDP2 and DTensor show it (their unsharded, cast or DTensor parameters are ``nn.Parameter``\\ s).
"""

from __future__ import annotations

from torch import Tensor, nn


def seen_as_parameter(value: Tensor, source: Tensor) -> Tensor:
    """``value``, an ``nn.Parameter`` to ``isinstance`` where ``source`` is one (same object).

    ``nn.Parameter(value)`` would detach it, and a cast or a DTensor must stay differentiable:
    the value is marked as ``nn.Parameter.__new__`` marks a parameter of a tensor subclass
    (``_is_param``, which ``isinstance`` reads), which changes nothing else about it.
    """
    if isinstance(source, nn.Parameter) and not isinstance(value, nn.Parameter):
        value._is_param = True  # type: ignore[attr-defined]
    return value

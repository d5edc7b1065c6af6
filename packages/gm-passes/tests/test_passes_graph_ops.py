"""``gm_passes.graph_ops``: the torch-free node queries, on test doubles of fx nodes."""

from __future__ import annotations

import operator
from types import SimpleNamespace

import pytest

from gm_passes import graph_ops
from gm_passes.graph_ops import has_side_effects, is_collective, is_wait, mutates_an_input, op_name


class Overload:
    """Like ``torch.ops.ns.name.overload``: prints as ``ns.name.overload``, has a schema."""

    def __init__(self, printed: str, *, mutable: bool = False):
        self.printed = printed
        self._schema = SimpleNamespace(is_mutable=mutable)

    def __str__(self) -> str:
        return self.printed


class Packet:
    """Like ``torch.ops.ns.name`` (an overload packet): prints as ``ns.name``, no schema."""

    def __init__(self, printed: str):
        self.printed = printed
        ns, name = printed.split(".")
        self._qualified_op_name = f"{ns}::{name}"
        # A packet forwards attribute lookups to the C++ op, whose __qualname__ is useless.
        self.__qualname__ = f"pybind11_detail_function_record.{name}"

    def __str__(self) -> str:
        return self.printed


def node(target, op="call_function", **extra):
    return SimpleNamespace(op=op, target=target, **extra)


def module_level_function(x):
    return x


class Holder:
    @staticmethod
    def method_(x):
        return x


# --- op_name --------------------------------------------------------------------------------


def test_op_name_of_a_string_target_is_the_string():
    assert op_name(node("aten.add.Tensor")) == "aten.add.Tensor"
    assert op_name(node("x", op="placeholder")) == "x"
    assert op_name(node("add_", op="call_method")) == "add_"


def test_op_name_of_an_op_overload_is_its_printed_name():
    assert op_name(node(Overload("aten.mm.default"))) == "aten.mm.default"


def test_op_name_of_an_overload_packet_is_its_printed_name():
    assert op_name(node(Packet("_c10d_functional.wait_tensor"))) == "_c10d_functional.wait_tensor"


def test_op_name_of_a_python_callable_is_its_qualified_name():
    assert op_name(node(module_level_function)) == "module_level_function"
    assert op_name(node(Holder.method_)) == "Holder.method_"
    assert op_name(node(operator.add)) == "add"


def test_op_name_falls_back_to_repr():
    class Opaque:
        __slots__ = ()

        def __repr__(self) -> str:
            return "<opaque target>"

    target = Opaque()
    assert not hasattr(target, "__qualname__") and not hasattr(target, "__name__")
    assert op_name(node(target)) == "<opaque target>"


# --- is_wait / is_collective ----------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        Overload("_c10d_functional.wait_tensor.default"),
        Overload("c10d_functional.wait_tensor.default"),
        "_c10d_functional.wait_tensor.default",
        Packet("_c10d_functional.wait_tensor"),
    ],
)
def test_is_wait(target):
    assert is_wait(node(target))


@pytest.mark.parametrize(
    ("target", "op"),
    [
        (Overload("_c10d_functional.all_gather_into_tensor.default"), "call_function"),
        (Overload("aten.add.Tensor"), "call_function"),
        (Overload("aten.wait_tensor_like.default"), "call_function"),
        ("wait_tensor", "call_function"),
        ("_c10d_functional.wait_tensor.default", "placeholder"),
        ("wait_tensor", "call_method"),
    ],
)
def test_is_not_wait(target, op):
    assert not is_wait(node(target, op=op))


@pytest.mark.parametrize(
    "target",
    [
        Overload("_c10d_functional.all_gather_into_tensor.default"),
        Overload("_c10d_functional.reduce_scatter_tensor.default"),
        Overload("_c10d_functional.all_reduce.default"),
        Overload("_c10d_functional.wait_tensor.default"),
        Overload("c10d_functional.all_reduce.default"),
        Overload("c10d.allreduce_.default"),
        Packet("_c10d_functional.all_gather_into_tensor"),
        "_c10d_functional.all_reduce.default",
    ],
)
def test_is_collective(target):
    assert is_collective(node(target))


@pytest.mark.parametrize(
    ("target", "op"),
    [
        (Overload("aten.add.Tensor"), "call_function"),
        (Overload("aten.all_gather.default"), "call_function"),
        (Overload("my_c10d_functional.all_reduce.default"), "call_function"),
        (Overload("xc10d.allreduce_.default"), "call_function"),
        ("_c10d_functional.all_reduce.default", "placeholder"),
        ("_c10d_functional.all_reduce.default", "get_attr"),
        (module_level_function, "call_function"),
    ],
)
def test_is_not_collective(target, op):
    assert not is_collective(node(target, op=op))


def test_every_wait_is_a_collective():
    wait = node(Overload("_c10d_functional.wait_tensor.default"))
    assert is_wait(wait) and is_collective(wait)


# --- mutates_an_input -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "op"),
    [
        (Overload("aten.copy_.default"), "call_function"),
        (Overload("aten.add_.Tensor"), "call_function"),
        ("aten.copy_.default", "call_function"),  # by name, no schema
        (Overload("aten.copy_.default", mutable=False), "call_function"),  # name is enough
        (Overload("aten.foo.out", mutable=True), "call_function"),  # schema is enough
        (Overload("aten.__iand__.Tensor", mutable=True), "call_function"),
        (Packet("aten.copy_"), "call_function"),
        ("add_", "call_method"),  # x.add_(y) from symbolic tracing
        ("copy_", "call_method"),
    ],
)
def test_mutates_an_input(target, op):
    assert mutates_an_input(node(target, op=op))


@pytest.mark.parametrize(
    ("target", "op"),
    [
        (Overload("aten.add.Tensor"), "call_function"),
        (Overload("aten.__and__.Tensor"), "call_function"),  # a dunder is not in-place
        (Overload("aten.mm.default", mutable=False), "call_function"),
        (Packet("aten.copy"), "call_function"),
        ("add", "call_method"),
        ("__add__", "call_method"),
        ("copy_", "placeholder"),
        ("aten.copy_.default", "output"),
        ("layer_", "call_module"),
        (Holder.method_, "call_function"),  # "Holder.method_": a Python function, no overload
        (module_level_function, "call_function"),
    ],
)
def test_does_not_mutate_an_input(target, op):
    assert not mutates_an_input(node(target, op=op))


# --- has_side_effects -----------------------------------------------------------------------


@pytest.mark.parametrize("op", ["placeholder", "output"])
def test_placeholders_and_output_have_side_effects(op):
    assert has_side_effects(node(op, op=op))


@pytest.mark.parametrize(
    "target",
    [
        Overload("_c10d_functional.all_gather_into_tensor.default"),
        Overload("_c10d_functional.wait_tensor.default"),
        Overload("aten.copy_.default"),
        Overload("aten.foo.out", mutable=True),
    ],
)
def test_collectives_waits_and_in_place_ops_have_side_effects(target):
    assert has_side_effects(node(target))


def test_an_impure_node_has_side_effects():
    calls = []

    def is_impure():
        calls.append(1)
        return True

    assert has_side_effects(node(Overload("aten.rand.default"), is_impure=is_impure))
    assert calls == [1]


def test_a_pure_node_has_no_side_effects():
    assert not has_side_effects(node(Overload("aten.add.Tensor")))  # no is_impure at all
    assert not has_side_effects(node(Overload("aten.add.Tensor"), is_impure=lambda: False))
    assert not has_side_effects(node(operator.add, is_impure=lambda: False))
    assert not has_side_effects(node("weight", op="get_attr"))


def test_a_non_callable_is_impure_attribute_is_ignored():
    assert not has_side_effects(node(Overload("aten.add.Tensor"), is_impure=True))


def test_collective_namespaces():
    assert graph_ops.COLLECTIVE_NAMESPACES == (
        "_c10d_functional.",
        "c10d_functional.",
        "c10d.",
        "gm_c10d.",
    )

"""``@register``, ``Dispatch``/``Execute`` and the dispatch/collect functions behind them."""

from .dispatch import (
    Dispatched,
    collect_all_to_all,
    collect_dp_compute,
    collect_dp_compute_data_proto,
    collect_nd_compute_dataproto,
    dispatch_all_to_all,
    dispatch_dp_compute,
    dispatch_dp_compute_data_proto,
    dispatch_dp_compute_data_proto_with_func,
    dispatch_nd_compute_dataproto,
    dispatch_one_to_all,
    get_predefined_dispatch_fn,
    make_nd_compute_dataproto_dispatch_fn,
    register_dispatch_mode,
    resolve_dispatch_mode,
    update_dispatch_mode,
)
from .modes import Dispatch, Execute, ExtensibleEnum
from .register import METHOD_SPEC_ATTR, MethodSpec, get_method_spec, register

__all__ = [
    "METHOD_SPEC_ATTR",
    "Dispatch",
    "Dispatched",
    "Execute",
    "ExtensibleEnum",
    "MethodSpec",
    "collect_all_to_all",
    "collect_dp_compute",
    "collect_dp_compute_data_proto",
    "collect_nd_compute_dataproto",
    "dispatch_all_to_all",
    "dispatch_dp_compute",
    "dispatch_dp_compute_data_proto",
    "dispatch_dp_compute_data_proto_with_func",
    "dispatch_nd_compute_dataproto",
    "dispatch_one_to_all",
    "get_method_spec",
    "get_predefined_dispatch_fn",
    "make_nd_compute_dataproto_dispatch_fn",
    "register",
    "register_dispatch_mode",
    "resolve_dispatch_mode",
    "update_dispatch_mode",
]

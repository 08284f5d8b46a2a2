"""Every tensor a DataProto carries also travels as a plain argument or result, on every
path: bf16 and float8 weights (a weight sync's state dict), conjugated and negated views."""

from __future__ import annotations

import pytest
import torch
from call_paths import PATHS, backend_on

import hybridflow_dask as hf


class Echo(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def echo(self, value):
        return value

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def echo_later(self, value):
        return value

    @hf.register(hf.Dispatch.RANK_ZERO)
    def state_dict(self, dtype_name: str):
        dtype = getattr(torch, dtype_name)
        return {"w": torch.arange(6.0).reshape(2, 3).to(dtype), "b": torch.ones(3).to(dtype)}


@pytest.fixture(scope="module", params=list(PATHS))
def group(request, hf_dask_cluster):
    with backend_on(request.param, hf_dask_cluster) as backend:
        wg = hf.WorkerGroup(hf.ResourcePool([1]), Echo, backend=backend)
        yield wg
        wg.shutdown()


def _odd_tensors() -> dict[str, torch.Tensor]:
    complex_values = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    return {
        "bf16": torch.linspace(-2, 2, 7).to(torch.bfloat16),
        "float8": torch.linspace(-2, 2, 7).to(torch.float8_e4m3fn),
        "conjugated": complex_values.conj(),
        "negated view": complex_values.conj().imag,
        "strided": torch.arange(20.0)[::3],
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    widen = (lambda t: t.resolve_conj().resolve_neg()) if a.is_complex() else (lambda t: t.float())
    a, b = a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(widen(a), widen(b))


@pytest.mark.parametrize("kind", list(_odd_tensors()))
def test_tensors_numpy_cannot_hold_travel_as_plain_arguments_and_results(group, kind):
    tensor = _odd_tensors()[kind]
    (back,) = group.echo(tensor)
    assert _same(back, tensor)
    (kept,) = hf.get(group.echo_later([tensor, {"nested": tensor}]))
    assert _same(kept[0], tensor) and _same(kept[1]["nested"], tensor)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e5m2"])
def test_a_low_precision_state_dict_comes_back_from_a_worker(group, dtype):
    weights = group.state_dict(dtype)
    assert weights["w"].dtype == getattr(torch, dtype)
    assert torch.equal(weights["w"].float(), torch.arange(6.0).reshape(2, 3))

"""The CUDA paths, on the built-in demo model (skipped without a GPU; README, "On a GPU", records the run on a
lent H200): reference numerics give one answer however positions are fed and the CPU's bits through the
first block, fast bf16 numerics take the grouped expert GEMM and stay as close to fp32 as the CPU's bf16
does, and an Engram lookup from a host table lands on the GPU with the CPU's bytes."""

from pathlib import Path

import pytest
import torch

import dsv41
from dsv41.config import RuntimeConfig
from dsv41.model import hyper
from dsv41.model.engram.table import EngramTable
from dsv41.model.moe import MoE
from dsv41.model.numerics import Numerics
from dsv41.tokenizer import Tokenizer

from test_moe import A, D, E, F_, LIMIT, make_moe, moe_oracle

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")

DEMO = Path(dsv41.__file__).parent / "demo_model"
TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer"
DECODED = 8            # positions fed one at a time after the prefill


def demo(device: str, numerics: str, dtype: str = "bfloat16"):
    runtime = RuntimeConfig(max_seq_len=128, max_batch_size=2, device=device, numerics=numerics, dtype=dtype)
    return dsv41.load(DEMO, runtime, progress=False)


def prompt() -> torch.Tensor:
    return torch.tensor([Tokenizer.from_dir(DEMO).encode(TEXT)])


@torch.inference_mode()
def logits(model, ids: torch.Tensor, decoded: int = 0) -> torch.Tensor:
    """fp32 logits [B, T, V] on the CPU: a prefill of all but `decoded` positions, then one call each."""
    ids = ids.to(model.embed.weight.device)
    cache = model.new_cache(ids.shape[0], 128)
    split = ids.shape[1] - decoded
    out = [model.logits(model(ids[:, :split], 0, cache).hidden)]
    out += [model.logits(model(ids[:, p:p + 1], p, cache).hidden) for p in range(split, ids.shape[1])]
    return torch.cat(out, dim=1).cpu()


def test_reference_numerics_on_cuda_give_one_answer_however_positions_are_fed():
    """A prefill, a prefill then decode steps, and the row beside another in a batch: the same bits."""
    ids = prompt()
    cuda = demo("cuda", "reference")
    assert cuda.numerics == Numerics("reference", "invariant")            # no native kernels off the CPU
    want = logits(cuda, ids)
    decoded = logits(cuda, ids, DECODED)
    differ = (decoded != want).sum().item()
    assert differ == 0, f"{differ} of {want.numel()} logits differ, by up to {(decoded - want).abs().max():.3g}"
    other = ids.flip(1)                                           # a second row of the same length
    both = logits(cuda, torch.cat([other, ids]), DECODED)
    assert torch.equal(both[1:], want) and torch.equal(both[:1], logits(cuda, other))


def test_reference_numerics_on_cuda_give_the_cpus_bits_through_the_first_block():
    """Block 0 (window attention, the quantised GEMMs, hyper-connections, MoE) gives the CPU's bits on the
    GPU: every product is an exact block sum or a float64 one rounded once. Later blocks may not: the
    fp32 reductions that reference numerics keep in torch's order (the RMS statistics, the Engram gate's
    sums, before block 1) are summed in another order by CUDA's kernels, and the fp8 / fp4 quantisation
    points turn a last-bit difference into a larger one (README, "On a GPU")."""
    ids = prompt()
    outputs = {}
    for device in ("cpu", "cuda"):
        model = demo(device, "reference")
        model.layers[0].register_forward_hook(lambda mod, inp, out, d=device: outputs.update({d: out[0].cpu()}))
        logits(model, ids)
    assert torch.equal(outputs["cpu"], outputs["cuda"])


def test_fast_bf16_on_cuda_takes_the_grouped_gemm_and_stays_as_close_to_fp32_as_the_cpus_bf16():
    ids = prompt()
    cuda = demo("cuda", "fast")
    assert cuda.numerics.grouped_experts
    exact = logits(demo("cpu", "fast", "float32"), ids)
    cpu_error = (logits(demo("cpu", "fast"), ids) - exact).abs().mean()
    for decoded in (0, DECODED):
        cuda_error = (logits(cuda, ids, decoded) - exact).abs().mean()
        assert cuda_error <= 2 * cpu_error, (decoded, cuda_error, cpu_error)


def test_the_triton_split_of_the_mixes_against_float64():
    """fast numerics' one-launch split on CUDA (gates and Sinkhorn) against hyper.py's torch ops in float64."""
    policy = Numerics.for_device("fast", None, "cuda")
    assert policy.triton
    S, M = 4, 24
    gen = torch.Generator(device="cuda").manual_seed(5)
    for rows in (1, 3, 1000):
        m = torch.randn(2, rows, M, device="cuda", generator=gen) * 3
        scale, base = torch.rand(3, device="cuda", generator=gen) + 0.5, torch.randn(M, device="cuda", generator=gen)
        got = hyper.split_mixes(m, scale, base, S, 20, 1e-6, policy)
        want = hyper.split_mixes(m.double(), scale.double(), base.double(), S, 20, 1e-6, Numerics("fast", "blas"))
        for g, w in zip(got, want):
            assert g.dtype == torch.float32 and g.shape == w.shape
            torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-6)


def test_the_grouped_expert_gemm_on_cuda_against_the_oracle():
    """Decode-sized calls (fewer pairs than experts: empty groups) and a prefill-sized one, in bf16."""
    moe, _ = make_moe("fast")
    grouped = MoE(D, F_, E, A, 1.5, LIMIT, "fp4", vision=True, numerics=Numerics("fast", "blas", "grouped"),
                  dtype=torch.bfloat16, device="cuda")
    grouped.load_state_dict(moe.state_dict())
    for n, seed in ((1, 7), (2, 9), (64, 8)):
        x = torch.randn(1, n, D, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        want = moe_oracle(moe, x.float(), None, quantised=False)
        got = grouped(x.cuda()).cpu().float()
        assert got.shape == want.shape and torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_an_engram_lookup_from_a_host_table_lands_on_cuda_with_the_cpus_values():
    table = EngramTable(4096, 64)
    gen = torch.Generator().manual_seed(3)
    table.weight.data.copy_((torch.randn(4096, 64, generator=gen) * 4).to(torch.float8_e4m3fn))
    table.scale.data.copy_(torch.full((4096, 2), 0.25).to(torch.float8_e8m0fnu))
    ids = torch.randint(0, 4096, (2, 5, 6), generator=gen)
    got = table.lookup(ids, "cuda")
    assert got.device.type == "cuda" and table.weight.device.type == "cpu"
    assert torch.equal(got.cpu(), table.lookup(ids))
    expected = table.weight.float()[ids] * 0.25                          # e4m3 × 2⁻²: exact in bf16
    assert torch.equal(got.cpu().float(), expected)

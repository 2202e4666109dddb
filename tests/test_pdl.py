"""Programmatic dependent launch (dspine.ops._common.pdl_kwargs / pdl_enter): the launch options per device, and
on the GPU the same bits with PDL on and off, back to back and inside a CUDA graph."""

import tests.kernel_env  # noqa: F401,I001  (before the kernel modules: sets TRITON_INTERPRET on a CPU machine)

import pytest
import torch

import dspine.ops._common as common
from dspine.ops._common import pdl_kwargs


def test_auto_mode_follows_the_target_size(monkeypatch):
    """Unset DSPINE_PDL: an engine turns PDL on (mode 3) for a target of hidden size >= 2048 and off below (where
    it slowed SmolLM2's step, results/engine-pdl-h200.json); a set PDL wins."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from infer.engine import Engine
    from infer.model import EngineTarget, ModelArgs

    assert [common.pdl_mode_for_hidden(h) for h in (576, 2047, 2048, 4096)] == [0, 0, 3, 3]
    monkeypatch.setattr(common, "PDL", None)
    monkeypatch.setattr(common, "PDL_AUTO_MODE", 0)
    modes = []
    for hidden in (64, 2048):
        cfg = Qwen3Config(vocab_size=64, hidden_size=hidden, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=64)
        hf = Qwen3ForCausalLM(cfg).eval()
        tgt = EngineTarget.from_hf_state(ModelArgs.from_hf_config(cfg), hf.state_dict(), "cpu", torch.float32, [0],
                                         "torch")
        modes.append((Engine(tgt, None, [-1], max_batch=1, max_seq=32).pdl_mode, common.PDL_AUTO_MODE))
    assert modes == [(0, 0), (3, 3)]
    monkeypatch.setattr(common, "PDL", 2)
    assert Engine(tgt, None, [-1], max_batch=1, max_seq=32).pdl_mode == 2 and common.PDL_AUTO_MODE == 3


def test_bad_env_value_is_refused_where_pdl_acts(monkeypatch):
    """A bad DSPINE_PDL does not break an import (--help, CPU paths); an engine refuses it in one ValueError that
    names the variable and the value."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", "import dspine.ops._common as c; print(c.PDL, c._PDL_OK)"],
                       env={**__import__("os").environ, "DSPINE_PDL": "bogus"}, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.split() == ["None", "False"], r.stderr
    monkeypatch.setattr(common, "_PDL_OK", False)
    monkeypatch.setenv("DSPINE_PDL", "bogus")
    with pytest.raises(ValueError, match="DSPINE_PDL='bogus'"):
        common.set_pdl_auto(4096)
    assert pdl_kwargs(torch.device("cpu"), 1) == {"PDL": 0}  # the CPU interpreter: PDL never acts


def test_pdl_off_on_cpu_and_when_switched_off(monkeypatch):
    assert pdl_kwargs(torch.device("cpu")) == {"PDL": 0}
    monkeypatch.setattr(common, "PDL", 0)
    assert pdl_kwargs(torch.device("cpu")) == {"PDL": 0}
    if torch.cuda.is_available():
        assert pdl_kwargs(torch.device("cuda")) == {"PDL": 0}


@pytest.mark.gpu
def test_pdl_mode_3_triggers_early_only_for_one_row(monkeypatch):
    """DSPINE_PDL=3: a launch over one row triggers its successor right after the wait (mode 1), any other launch
    waits only (mode 2); the CPU keeps PDL off whatever the rows."""
    monkeypatch.setattr(common, "PDL", 3)
    dev = torch.device("cuda")
    assert pdl_kwargs(dev, 1) == {"launch_pdl": True, "PDL": 1}
    assert pdl_kwargs(dev, 16) == {"launch_pdl": True, "PDL": 2}
    assert pdl_kwargs(dev) == {"launch_pdl": True, "PDL": 2}
    assert pdl_kwargs(torch.device("cpu"), 1) == {"PDL": 0}


def _chain(x, ws, norm_w):
    """A chain of dependent small kernels, as in a decode step: rmsnorm(+residual) -> linear (split K, fused
    reduce) -> silu_mul -> linear; every kernel reads what the one before it wrote."""
    from dspine.ops.linear import linear
    from dspine.ops.rmsnorm import rms_norm
    from dspine.ops.silu_mul import silu_mul

    res = x
    for w_up, w_down in ws:
        h, res = rms_norm(x, norm_w, 1e-6, residual=res)
        x = linear(silu_mul(linear(h, w_up)), w_down)
    return x + res


@pytest.mark.gpu
def test_pdl_same_bits_eager_and_graph(monkeypatch):
    """24 layers of dependent kernels at M 1 and 8: PDL on gives the bits of PDL off, eagerly (50 repeats) and in
    a CUDA graph replayed 20 times (a kernel that read its input before its predecessor wrote it would differ)."""
    dev = torch.device("cuda")
    monkeypatch.setattr(common, "PDL", 1)
    assert pdl_kwargs(dev) == {"launch_pdl": True, "PDL": 1}
    g = torch.Generator().manual_seed(0)
    H, inter = 1024, 2816
    ws = [((torch.randn(2 * inter, H, generator=g) / H**0.5).to(torch.bfloat16).cuda(),
           (torch.randn(H, inter, generator=g) / inter**0.5).to(torch.bfloat16).cuda()) for _ in range(24)]
    norm_w = (1 + 0.1 * torch.randn(H, generator=g)).to(torch.bfloat16).cuda()
    for M, mode in ((1, 1), (8, 1), (1, 2), (1, 3), (16, 3)):
        x = torch.randn(M, H, generator=g).to(torch.bfloat16).cuda()
        monkeypatch.setattr(common, "PDL", 0)
        ref = _chain(x, ws, norm_w)
        torch.cuda.synchronize()
        monkeypatch.setattr(common, "PDL", mode)
        outs = [_chain(x, ws, norm_w) for _ in range(50)]
        torch.cuda.synchronize()
        assert all(torch.equal(o.view(torch.int16), ref.view(torch.int16)) for o in outs), (M, mode)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            _chain(x, ws, norm_w)  # warm-up (compiles, tile counters) before the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=s):
                y = _chain(x, ws, norm_w)
        torch.cuda.current_stream().wait_stream(s)
        for _ in range(20):
            y.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y.view(torch.int16), ref.view(torch.int16)), (M, mode, "graph")


@pytest.mark.gpu
@pytest.mark.parametrize("exact", [False, True])
def test_pdl_engine_same_output(monkeypatch, exact):
    """The engine (CUDA graphs, bf16, a small random Qwen3 and a random draft) decodes the same tokens with PDL on
    as with it off, AR and speculative, at concurrency 1 and 4."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dspine.sampling import SamplingParams
    from infer.engine import Engine
    from infer.model import EngineTarget, ModelArgs
    from tests.test_exact import _draft_for

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                      rope_theta=1e6, tie_word_embeddings=False, initializer_range=0.1)
    hf = Qwen3ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 4000, (int(n),), generator=g).tolist() for n in torch.randint(3, 300, (8,), generator=g)]
    params = SamplingParams(max_new_tokens=96)
    got = {}
    for pdl in (0, 1, 3):
        monkeypatch.setattr(common, "PDL", pdl)
        tgt = EngineTarget.from_hf_state(ModelArgs.from_hf_config(cfg), hf.state_dict(), "cuda", torch.bfloat16,
                                         [0, 3], "triton")
        torch.manual_seed(1)
        eng = Engine(tgt, _draft_for(tgt, block=16), [-1], max_batch=4, max_seq=600, exact=exact, cuda_graphs=True)
        got[pdl] = [eng.generate(prompts, params, use_draft=d, concurrency=c).token_ids
                    for d in (False, True) for c in (1, 4)]
    assert got[1] == got[0]
    assert got[3] == got[0]


def test_every_pdl_launch_targets_a_kernel_that_waits_first():
    """docs/contracts.md: a kernel launched with ``**pdl_kwargs(...)`` takes ``PDL: tl.constexpr`` and calls
    ``pdl_enter(PDL)`` as its first statement (after the docstring). Checked on the source of dspine/ops/, so a
    new kernel that forgets the wait (and could read its inputs before its predecessor wrote them) fails here."""
    import ast
    from pathlib import Path

    ops = Path(common.__file__).parent
    kernels, launched = {}, set()
    for f in sorted(ops.glob("*.py")):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
                first = ast.unparse(body[0]) if body else ""
                kernels[node.name] = ("PDL" in [a.arg for a in node.args.args], first)
            if isinstance(node, ast.Call) and any(isinstance(k.value, ast.Call) and ast.unparse(k.value.func) == "pdl_kwargs"
                                                  for k in node.keywords if k.arg is None):
                launched.add((f.name, ast.unparse(node.func).split("[")[0].split(".")[-1]))
    assert len(launched) >= 8, launched  # linear (2), rmsnorm, silu_mul, rope, verify attention, combine (2)
    for fname, name in sorted(launched):
        has_pdl, first = kernels[name]
        assert has_pdl and first == "pdl_enter(PDL)", (fname, name, first)

"""Step speed-ups of the trainer (issue 15, train/speed.py): regional compile of the decoder layers
(``compile_layers``), the fused AdamW (``adamw_impl``) and the compiled CE chunk (``ce_impl``) in
``train/distill.py``.

On the CPU, torch.compile runs with the ``aot_eager`` backend (dynamo capture and AOTAutograd, no Inductor
code generation, which takes ~30 s cold for the stories260K layers); the trainer's wiring is the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO
from tests.helpers import random_draft
from train import speed


@pytest.fixture
def aot_eager_compile(monkeypatch):
    """torch.compile with backend aot_eager; returns the keyword arguments of every call."""
    calls, compile_ = [], torch.compile

    def compile(fn, **kw):
        calls.append({"fn": getattr(fn, "__qualname__", repr(fn)), **kw})
        return compile_(fn, backend="aot_eager", **kw)

    monkeypatch.setattr(torch, "compile", compile)
    return calls


def test_compiled_layers_give_the_eager_loss_and_gradients(stories_dir, aot_eager_compile):
    from dspine.target import decoder_layers, load_target
    from train.data import make_batch
    from train.loss import anchor_generator
    from train.step import StepSettings, micro_loss

    target = load_target(str(stories_dir), dtype="fp32")
    draft = random_draft(target, block_size=8, mask=0).train()
    target.set_layer_ids(draft.config.target_layer_ids, draft.config.last_layer_features)
    g = torch.Generator().manual_seed(0)
    rows = [
        {
            "input_ids": [1, *torch.randint(3, 512, (39,), generator=g).tolist()],
            "loss_mask": [0] * 8 + [1] * 32,
        }
        for _ in range(2)
    ]
    batch = make_batch(
        rows,
        [0, 1],
        max_length=40,
        block_size=8,
        mask_token_id=0,
        gamma=7.0,
        anchors_per_seq=8,
        generator=anchor_generator(0, 0, 0, 0),
    )
    settings = StepSettings(8, "dense", 2048, 1.0)

    def loss_and_grads():
        draft.zero_grad(set_to_none=True)
        loss, stats = micro_loss(draft, target, batch, settings)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}

    eager_loss, eager_grads = loss_and_grads()
    fws = speed.compile_layers(target, draft, "both", shapes=1)
    t_layers, d_layers = list(decoder_layers(target.model)), list(draft.layers)
    assert [fw.modules for fw in fws] == [t_layers, d_layers] and all(fw.active for fw in fws)
    assert [c["dynamic"] for c in aot_eager_compile] == [False] * (len(t_layers) + len(d_layers))
    assert {c["fn"] for c in aot_eager_compile} == {"LlamaDecoderLayer.forward", "DraftLayer.forward"}
    assert all(m.forward is c for fw in fws for m, c in zip(fw.modules, fw.compiled))
    loss, grads = loss_and_grads()
    assert eager_loss > 0 and torch.allclose(loss, eager_loss, rtol=1e-6)
    assert grads.keys() == eager_grads.keys() and len(grads) > 10
    for n, grad in grads.items():
        assert torch.allclose(grad, eager_grads[n], rtol=1e-5, atol=1e-7), n
    with speed.eager_forwards(fws):  # e.g. the tau_real decode
        assert all(m.forward == e for fw in fws for m, e in zip(fw.modules, fw.eager)) and not fws[0].active
    assert all(m.forward is c for fw in fws for m, c in zip(fw.modules, fw.compiled)) and fws[1].active
    assert speed.compile_layers(target, draft, "none") == []
    assert len(aot_eager_compile) == len(t_layers) + len(d_layers)  # nothing compiled again


def test_set_fused_adam_reaches_the_inner_optimizer_and_keeps_resume_exact():
    """Through accelerate's wrapper and a ZeRO-like ``.optimizer`` wrapper; the fused kernel's updates equal
    the default path's within rounding; a state saved and loaded into a default-path optimizer, switched
    back to fused, continues exactly as the uninterrupted run."""
    from accelerate import Accelerator

    from train.step import make_optimizer

    class ZeroLike:  # DeepSpeed's ZeRO optimizer keeps the torch optimizer as .optimizer
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def __getattr__(self, name):
            return getattr(self.optimizer, name)

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))

    def steps(m, opt, n):
        for _ in range(n):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    runs = {}
    for fused in (False, True):
        m = model()
        opt = make_optimizer(m, 1e-2, 0.1, (0.9, 0.95), fused=fused)
        assert opt.param_groups[0]["fused"] is (True if fused else None)
        steps(m, opt, 4)
        runs[fused] = (m, opt)
    for a, b in zip(runs[False][0].parameters(), runs[True][0].parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7) and not torch.equal(a, model()[0].weight)

    # switched through the wrappers: the inner optimizer's groups and its step state
    m = model()
    inner = make_optimizer(m, 1e-2, 0.1, (0.9, 0.95))
    wrapped = Accelerator(cpu=True).prepare_optimizer(ZeroLike(inner))  # accelerate's wrapper around ZeRO's
    assert type(wrapped).__name__ == "AcceleratedOptimizer" and speed.torch_optimizer(wrapped) is inner
    steps(m, inner, 2)
    speed.set_fused_adam(wrapped, True)
    assert all(g["fused"] is True and g["foreach"] is None for g in inner.param_groups)
    steps_state = lambda: [inner.state[p]["step"] for p in m.parameters()]
    assert all(st.device == p.device and float(st) == 2 for st, p in zip(steps_state(), m.parameters()))
    speed.set_fused_adam(wrapped, False)
    assert all(g["fused"] is None for g in inner.param_groups)
    assert all(st.device.type == "cpu" and float(st) == 2 for st in steps_state())
    # ZeRO-3 empties each group's params outside its step: the state is still reached (by its own keys). On a
    # CPU both paths keep ``step`` on the CPU, so a recording stand-in shows where each state was sent
    class Step:
        def __init__(self, real):
            self.real, self.sent = real, []

        def to(self, device):
            self.sent.append(str(device))
            return self

    kept = [g["params"] for g in inner.param_groups]
    for g in inner.param_groups:
        g["params"] = []
    for p in m.parameters():
        inner.state[p]["step"] = Step(inner.state[p]["step"])
    ghost = torch.empty(1, device="meta")  # a state key on another device: fused must send its step there
    inner.state[ghost] = {"step": Step(None)}
    speed.set_fused_adam(wrapped, True)
    assert [st.sent for st in steps_state()] == [["cpu"]] * len(list(m.parameters()))  # fused: the param's device
    assert inner.state.pop(ghost)["step"].sent == ["meta"]
    for g, params in zip(inner.param_groups, kept):
        g["params"] = params
    for p in m.parameters():
        inner.state[p]["step"] = inner.state[p]["step"].real
    speed.set_fused_adam(wrapped, False)

    # resume: 2 fused steps, state saved, loaded into a default-path optimizer, switched to fused, 2 more steps
    straight = model()
    opt = make_optimizer(straight, 1e-2, 0.1, (0.9, 0.95), fused=True)
    steps(straight, opt, 4)
    first = model()
    opt = make_optimizer(first, 1e-2, 0.1, (0.9, 0.95), fused=True)
    steps(first, opt, 2)
    saved_model, saved_opt = first.state_dict(), opt.state_dict()
    resumed = model()
    resumed.load_state_dict(saved_model)
    opt = make_optimizer(resumed, 1e-2, 0.1, (0.9, 0.95))
    opt.load_state_dict(saved_opt)
    speed.set_fused_adam(opt, True)
    steps(resumed, opt, 2)
    # load_state_dict brings the saved groups' flags: a default-path state turns a fused optimizer off
    fused_opt = make_optimizer(model(), 1e-2, 0.1, (0.9, 0.95), fused=True)
    fused_opt.load_state_dict(inner.state_dict())
    assert fused_opt.param_groups[0]["fused"] is None
    speed.set_fused_adam(fused_opt, True)
    assert fused_opt.param_groups[0]["fused"] is True
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_recompile_limit_covers_the_length_buckets():
    import torch._dynamo as dynamo

    name = "recompile_limit" if hasattr(dynamo.config, "recompile_limit") else "cache_size_limit"
    assert speed.length_buckets(3072, 512) == 6 and speed.length_buckets(3000, 512) == 6
    assert speed.length_buckets(40, 1) == 40 and speed.length_buckets(40, 0) == 40
    # dynamo's own patch, not monkeypatch: monkeypatch's undo left the recompile_limit alias hidden, and every later
    # flex_attention call in that process failed ("torch._dynamo.config.recompile_limit does not exist")
    with dynamo.config.patch({name: 8}):
        assert speed.allow_recompiles(6) == 14  # 6 lengths x (grad, no grad) + 2
        assert getattr(dynamo.config, name) == 14
        assert speed.allow_recompiles(1) == 14  # never lowered
        assert speed.allow_recompiles(3072) == 64  # capped: unpadded lengths would compile without end


RUNNER = r"""
import json, os, sys
import torch

sys.path.insert(0, os.environ["REPO"])
calls, compile_ = {"compiled": [], "runs": {}, "decode_runs": []}, torch.compile


def compile(fn, **kw):
    name = getattr(fn, "__qualname__", repr(fn))
    calls["compiled"].append({"fn": name, **kw})
    compiled = compile_(fn, backend="aot_eager", **kw)

    def run(*a, **k):
        calls["runs"][name] = calls["runs"].get(name, 0) + 1
        return compiled(*a, **k)
    return run


torch.compile = compile
import dspine.reference as reference

generate = reference.ReferenceDecoder.generate


def counted_generate(self, *a, **k):
    before = sum(calls["runs"].values())
    out = generate(self, *a, **k)
    calls["decode_runs"].append(sum(calls["runs"].values()) - before)
    return out


reference.ReferenceDecoder.generate = counted_generate
from train.distill import main

rc = main(sys.argv[1:])
with open(os.environ["CALLS_OUT"], "w") as f:
    json.dump(calls, f)
sys.exit(rc)
"""


@pytest.mark.slow
def test_trainer_speedups_same_loss_eager_decode_and_exact_resume(stories_dir, tmp_path):
    """compile_layers=both, ce_impl=compiled, adamw_impl=fused on the CPU: the losses of the eager run, the
    settings recorded under `resolved`, the tau_real decode on the eager forwards, and resume exact."""
    g = torch.Generator().manual_seed(0)
    with open(tmp_path / "rows.jsonl", "w") as f:
        for i in range(24):
            ids = [1, *torch.randint(3, 512, (39,), generator=g).tolist()]
            f.write(json.dumps({"id": f"r{i}", "input_ids": ids, "loss_mask": [0] * 6 + [1] * 34}) + "\n")
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER)
    common = [
        "--config",
        str(REPO / "configs" / "stories260k-cpu.yaml"),
        f"target={stories_dir}",
        f"train={tmp_path / 'rows.jsonl'}",
        f"eval={tmp_path / 'rows.jsonl'}",
        "max_steps=4",
        "log_every=1",
        "eval_every=4",
        "eval_max_rows=4",
        "eval_prompts=2",
        "eval_max_new_tokens=10",
        "micro_batch_size=4",
        "anchors_per_seq=8",
        "max_length=40",
        "save_every=2",
        "keep_last=0",
    ]
    fast = ["compile_layers=both", "ce_impl=compiled", "adamw_impl=fused"]

    def speedups(folder):
        resolved = json.loads((folder / "config.json").read_text())["resolved"]
        return resolved["ce_impl"], resolved["adamw_impl"], resolved["compile_layers"]

    def run(name, *extra):
        out = tmp_path / name
        r = subprocess.run(
            [sys.executable, str(runner), *common, f"output_dir={out}", *extra],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
            env={**os.environ, "REPO": str(REPO), "CALLS_OUT": str(out) + ".calls.json"},
        )
        assert r.returncode == 0, r.stderr[-4000:]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return out, rows, json.loads((tmp_path / f"{name}.calls.json").read_text())

    eager_out, eager_rows, eager_calls = run("eager")
    assert eager_calls["compiled"] == [] and eager_calls["decode_runs"] == [0]  # CPU auto: nothing compiled
    assert speedups(eager_out) == ("eager", "default", "none")
    out, rows, calls = run("fast", *fast)
    assert speedups(out) == speedups(out / "step-4") == ("compiled", "fused", "both")
    layers = [c for c in calls["compiled"] if c["fn"].endswith("Layer.forward")]
    assert sorted({c["fn"] for c in layers}) == ["DraftLayer.forward", "LlamaDecoderLayer.forward"]
    assert len(layers) == 5 + 2 and all(c["dynamic"] is False for c in layers)  # 5 target + 2 draft layers
    assert {c["fn"] for c in calls["compiled"]} - {c["fn"] for c in layers} == {"ce_chunk"}
    # compiled calls: 4 steps and the eval's one micro-batch; the target runs layers 0-2 for the features (target
    # layers [1, 2], the default for 5 layers), all 5 for the eval's last hidden state; the eval's soft loss does
    # not use the CE chunk
    draft_cfg = json.loads((out / "step-4" / "draft" / "config.json").read_text())
    assert draft_cfg["dflash_config"]["target_layer_ids"] == [1, 2]
    assert calls["runs"] == {
        "LlamaDecoderLayer.forward": 4 * 3 + 5,
        "DraftLayer.forward": 5 * 2,
        "ce_chunk": 4,
    }
    assert calls["decode_runs"] == [0]  # tau_real decodes on the eager forwards (no compile per length)
    train, evals = [r for r in rows if "loss" in r], [r for r in rows if "eval/loss" in r]
    eager_train = [r for r in eager_rows if "loss" in r]
    eager_eval = [r for r in eager_rows if "eval/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and len(evals) == 1 and "eval/tau_real" in evals[0]
    for a, b in zip(train, eager_train):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert evals[0]["eval/loss"] == pytest.approx(eager_eval[0]["eval/loss"], rel=1e-4)
    # exact resume with the speed-ups on: 2 steps, a new process, 2 more == 4 straight
    resumed, _, _ = run("resumed", *fast, "stop_after_steps=2")
    resumed, resumed_rows, _ = run("resumed", *fast)
    resumed_train = [(r["step"], r["loss"], r["grad_norm"]) for r in resumed_rows if "loss" in r]
    assert resumed_train == [(r["step"], r["loss"], r["grad_norm"]) for r in train]


def test_resume_notes_changed_speedups(tmp_path, capsys):
    """A resume whose resolved step speed-ups differ from the checkpoint's prints a note (the continuation is
    not bitwise); the same ones print nothing; a checkpoint from before the options counts as eager."""
    import json

    from train import config as run_config
    from train.distill import check_resumed_config

    cfg = run_config.RunConfig(target="t", train="d")
    ran = {"ce_impl": "eager", "adamw_impl": "default", "compile_layers": "none"}
    (tmp_path / "config.json").write_text(json.dumps({**run_config.to_dict(cfg), "resolved": ran}))
    check_resumed_config(tmp_path, cfg, dict(ran))
    assert "note" not in capsys.readouterr().out
    check_resumed_config(tmp_path, cfg, {**ran, "adamw_impl": "fused", "compile_layers": "both"})
    out = capsys.readouterr().out
    assert "adamw_impl: default -> fused; compile_layers: none -> both" in out and "not bitwise" in out
    (tmp_path / "config.json").write_text(json.dumps(run_config.to_dict(cfg)))  # saved before the options
    check_resumed_config(tmp_path, cfg, dict(ran))
    assert "note" not in capsys.readouterr().out  # it ran eager / default / none
    check_resumed_config(tmp_path, cfg, {**ran, "ce_impl": "compiled"})
    assert "ce_impl: eager -> compiled" in capsys.readouterr().out

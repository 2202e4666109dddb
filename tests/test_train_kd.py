"""Knowledge distillation (run config ``distill``; docs/method.md §4): the soft-target chunked CE, the
target positions a+k-1, the target's last layer, the config checks, and the trainer with ``distill=kl``
on stories260K (loss falls, KL and argmax agreement logged, exact resume)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F

from data.sample_target import main as sample_main
from tests.conftest import REPO
from train.config import ConfigError, load
from train.loss import (
    DistillTargets,
    block_loss,
    block_targets,
    fused_linear_cross_entropy,
    fused_linear_soft_cross_entropy,
    naive_linear_soft_cross_entropy,
    target_positions,
)


def soft_case(seed: int, dtype=torch.float64, R=37, H=24, V=101, U=11):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(R, H, generator=g, dtype=dtype)
    weight = torch.randn(V, H, generator=g, dtype=dtype) * 0.5
    labels = torch.randint(0, V, (R,), generator=g)
    w = torch.rand(R, generator=g, dtype=dtype)
    w[::4] = 0
    target = torch.randn(U, H, generator=g, dtype=dtype)
    index = torch.randint(0, U, (R,), generator=g)
    return hidden, weight, labels, w, target, index


def formula(hidden, weight, labels, w, target, index, alpha, T):
    """The loss written out: α·CE(y, softmax(z)) + (1-α)·T²·(-Σ p log q), p = softmax(u/T), q = softmax(z/T)."""
    z, u = hidden @ weight.t(), target[index] @ weight.t()
    p = torch.softmax(u / T, -1)
    soft = -(p * torch.log_softmax(z / T, -1)).sum(-1)
    ce = torch.logsumexp(z, -1) - z.gather(1, labels[:, None]).squeeze(1)
    kl = (p * (torch.log_softmax(u / T, -1) - torch.log_softmax(z / T, -1))).sum(-1)
    return (w * (alpha * ce + (1 - alpha) * T * T * soft)).sum(), (w * kl).sum(), (w * ce).sum()


@pytest.mark.parametrize("alpha,T", [(0.0, 1.0), (0.3, 2.0), (1.0, 1.0)])
def test_soft_ce_value_and_gradient_equal_the_formula_fp64(alpha, T):
    hidden, weight, labels, w, target, index = soft_case(int(alpha * 10 + T))
    h_ref = hidden.clone().requires_grad_(True)
    ref, ref_kl, ref_ce = formula(h_ref, weight, labels, w, target, index, alpha, T)
    ref.backward()
    ref, ref_kl, ref_ce = ref.detach(), ref_kl.detach(), ref_ce.detach()
    for fn in (fused_linear_soft_cross_entropy, naive_linear_soft_cross_entropy):
        h = hidden.clone().requires_grad_(True)
        loss, correct, agree, kl, ce, _ = fn(h, weight, labels, w, target, index, alpha, T, 5)
        (loss * 3.0).backward()  # a non-unit upstream gradient
        assert float(loss.detach()) == pytest.approx(float(ref), rel=1e-12)
        assert float(kl) == pytest.approx(float(ref_kl), rel=1e-10) and float(kl) > 0.1
        assert float(ce) == pytest.approx(float(ref_ce), rel=1e-12)
        assert (h.grad / 3.0 - h_ref.grad).abs().max() < 1e-12 and h_ref.grad.abs().max() > 0.05
        z, u = hidden @ weight.t(), target[index] @ weight.t()
        assert torch.equal(correct, z.argmax(-1) == labels) and torch.equal(agree, z.argmax(-1) == u.argmax(-1))
    # and against finite differences (9 rows, chunks of 4)
    f = lambda h: fused_linear_soft_cross_entropy(h, weight, labels[:9], w[:9], target, index[:9], alpha, T, 4)[0]
    assert torch.autograd.gradcheck(f, (hidden[:9].clone().requires_grad_(True),))


def test_soft_ce_does_not_depend_on_the_chunk_size():
    args = soft_case(7)
    outs = []
    for chunk in (1, 5, 16, 37, 1000):
        h = args[0].clone().requires_grad_(True)
        loss, correct, agree, kl, ce, _ = fused_linear_soft_cross_entropy(h, *args[1:], 0.25, 1.5, chunk)
        loss.backward()
        outs.append((float(loss.detach()), float(kl), float(ce), correct, agree, h.grad))
    for o in outs[1:]:
        assert o[0] == pytest.approx(outs[0][0], rel=1e-13) and o[1] == pytest.approx(outs[0][1], rel=1e-12)
        assert o[2] == pytest.approx(outs[0][2], rel=1e-13)
        assert torch.equal(o[3], outs[0][3]) and torch.equal(o[4], outs[0][4])
        assert (o[5] - outs[0][5]).abs().max() < 1e-13
    # fp32 (what the trainer runs): same budget as the hard-label fused CE against the fp64 value
    h32 = args[0].float().requires_grad_(True)
    loss32 = fused_linear_soft_cross_entropy(h32, *[a.float() if a.is_floating_point() else a for a in args[1:]],
                                             0.25, 1.5, 16)[0]
    loss32.backward()
    assert float(loss32.detach()) == pytest.approx(outs[0][0], rel=1e-5)
    assert (h32.grad.double() - outs[0][5]).abs().max() < 1e-4


def test_kl_with_a_one_hot_target_equals_hard_ce():
    """p one-hot at the label: CE(p, q) = KL(p ‖ q) = CE(y, q), the same gradient, agreement = accuracy."""
    hidden, weight, labels, w, _, _ = soft_case(3, dtype=torch.float32, V=24)
    weight = torch.eye(24)  # V = H: logits = hidden rows, so the target rows below give one-hot p
    target = 200.0 * F.one_hot(labels, 24).float()  # exp(-200) underflows: p is exactly one-hot in fp32
    index = torch.arange(len(labels))
    h_kl, h_ce = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    kl_loss, correct, agree, kl, _, _ = fused_linear_soft_cross_entropy(h_kl, weight, labels, w, target, index, 0.0, 1.0, 8)
    ce_loss, ce_correct = fused_linear_cross_entropy(h_ce, weight, labels, w, 8)
    kl_loss.backward()
    ce_loss.backward()
    kl_loss, ce_loss = kl_loss.item(), ce_loss.item()
    assert kl_loss == pytest.approx(ce_loss, rel=1e-6) and ce_loss > 1.0
    assert float(kl) == pytest.approx(ce_loss, rel=1e-6)  # H(one-hot) = 0: KL = CE
    assert (h_kl.grad - h_ce.grad).abs().max() < 1e-6
    assert torch.equal(agree, correct) and torch.equal(correct, ce_correct)


@pytest.mark.parametrize("T", [1.0, 2.0])
def test_overlap_is_the_sampling_acceptance_and_only_without_a_gradient(T):
    """Without a gradient kept, the fused op returns per row Σ_v min(p_v, q_v) (p, q at temperature T), the
    naive reference's value, for any chunk size; 1 when draft and target rows coincide; with a gradient, none."""
    hidden, weight, labels, w, target, index = soft_case(11)
    z, u = hidden @ weight.t(), target[index] @ weight.t()
    ref = torch.minimum(torch.softmax(z / T, -1), torch.softmax(u / T, -1)).sum(-1)
    assert 0.01 < float(ref.min()) and float(ref.max()) < 0.999  # a real spread of values to compare
    for chunk in (1, 7, 1000):
        with torch.no_grad():
            got = fused_linear_soft_cross_entropy(hidden, weight, labels, w, target, index, 0.5, T, chunk)[5]
        assert (got - ref).abs().max() < 1e-12
    assert (naive_linear_soft_cross_entropy(hidden, weight, labels, w, target, index, 0.5, T)[5] - ref).abs().max() < 1e-12
    with torch.no_grad():  # the target's own rows as the draft's: q = p
        same = fused_linear_soft_cross_entropy(target[index], weight, labels, w, target, index, 0.0, T, 5)[5]
    assert (same - 1).abs().max() < 1e-12
    h = hidden.clone().requires_grad_(True)
    assert fused_linear_soft_cross_entropy(h, weight, labels, w, target, index, 0.5, T, 5)[5].numel() == 0


@pytest.mark.gpu
def test_soft_ce_cuda_bf16_weight_close_to_fp32_reference():
    """The trainer's GPU case: bf16 lm_head and target rows, fp32 draft rows, SmolLM2-like vocab."""
    g = torch.Generator().manual_seed(5)
    R, H, V = 3000, 64, 49152
    hidden, weight = torch.randn(R, H, generator=g), torch.randn(V, H, generator=g) * 0.2
    target, labels = torch.randn(R, H, generator=g), torch.randint(0, V, (R,), generator=g)
    w, index = torch.rand(R, generator=g), torch.randperm(R, generator=g)
    h = hidden.cuda().requires_grad_(True)
    loss, _, agree, kl, _, _ = fused_linear_soft_cross_entropy(h, weight.cuda().bfloat16(), labels.cuda(), w.cuda(),
                                                           target.cuda().bfloat16(), index.cuda(), 0.0, 1.0, 1024)
    loss.backward()
    h64 = hidden.double().requires_grad_(True)
    ref, ref_kl, _ = formula(h64, weight.double(), labels, w.double(), target.bfloat16().double(), index, 0.0, 1.0)
    ref.backward()
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=2e-3)
    assert float(kl) == pytest.approx(float(ref_kl.detach()), rel=1e-2)
    rel = (h.grad.double().cpu() - h64.grad).norm() / h64.grad.norm()
    assert rel < 2e-2 and agree.float().mean() < 0.5


def test_soft_ce_refuses_bad_arguments():
    args = soft_case(1)
    for kw, msg in (({"alpha": 1.5}, "alpha=1.5"), ({"temperature": 0.0}, "temperature=0.0"),
                    ({"chunk_size": 0}, "chunk_size=0")):
        with pytest.raises(ValueError, match=msg):
            fused_linear_soft_cross_entropy(*args, **kw)


def test_target_positions_by_hand():
    anchors = torch.tensor([[2, 5, -1]])
    assert target_positions(anchors, 3).tolist() == [[0, 2, 3, 0, 5, 6, 0, 0, 0]]


def test_block_loss_reads_the_target_at_a_plus_k_minus_1():
    """A target that puts all its mass on the true next token: kl == ce row by row, agree == correct.
    Reading the target one position off (a+k or a+k-2) would make the loss and the agreement differ."""
    bs, V = 4, 16
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :3] = 0
    lengths = torch.tensor([12, 9])
    anchors = torch.tensor([[3, 6, 8], [0, 5, -1]])
    labels, w = block_targets(ids, mask, lengths, anchors, bs, 7.0)
    # last_hidden[b, p] is one-hot of the token at p+1 (identity norm and lm_head): p_target = onehot(x_{p+1})
    nxt = torch.cat([ids[:, 1:], ids[:, :1]], 1)
    last = 300.0 * F.one_hot(nxt, V).float()
    hidden = 8.0 * F.one_hot(labels, V).float() + 0.5 * torch.randn(2, 3 * bs, V, generator=g)  # a good draft
    out = {}
    for name, distill in (("ce", None), ("kl", DistillTargets(last, lambda x: x, anchors, 0.0, 1.0))):
        h = hidden.clone().requires_grad_(True)
        loss, stats = block_loss(h, torch.eye(V), labels, w, bs, chunk_size=5, distill=distill)
        loss.backward()
        out[name] = (loss.item(), stats, h.grad)
    assert out["kl"][0] == pytest.approx(out["ce"][0], rel=1e-6)
    assert (out["kl"][2] - out["ce"][2]).abs().max() < 1e-6
    st = out["kl"][1]
    assert st.soft and st.kl_sum == pytest.approx(out["ce"][0], rel=1e-6) and st.ce_sum == pytest.approx(out["ce"][0], rel=1e-6)
    assert torch.equal(st.agree, st.correct) and st.count.sum() == int((w > 0).sum()) > 10
    assert st.agreement == st.accuracy and out["ce"][1].agreement is None
    shifted = DistillTargets(torch.roll(last, 1, dims=1), lambda x: x, anchors, 0.0, 1.0)  # off by one
    loss_off, _ = block_loss(hidden, torch.eye(V), labels, w, bs, distill=shifted)
    assert loss_off.item() > 20 * out["ce"][0] > 0


def test_config_distill_keys_and_refusals(tmp_path):
    cfg = load(None, ["target=t", "train=x", "distill=mix", "distill_alpha=0.25", "distill_temperature=2"])
    assert (cfg.distill, cfg.distill_alpha, cfg.distill_temperature) == ("mix", 0.25, 2.0)
    assert load(None, ["target=t", "train=x"]).distill == "ce"  # off by default
    assert load(None, ["target=t", "train=x", "distill=mix"]).distill_alpha is None  # unset: mix weighs 0.5
    for bad, msg in ((["distill=soft"], "'distill'"), (["distill_alpha=1.5"], "'distill_alpha'"),
                     (["distill_temperature=0"], "'distill_temperature'"),
                     (["distill=kl", f"feature_source={tmp_path}"], "feature_source=online"),
                     # only mix weighs two terms: alpha with ce or kl would be dropped without a word
                     (["distill_alpha=0.25"], "'distill_alpha': 0.25 weighs the two terms of distill=mix only; "
                                               "distill=ce would ignore it"),
                     (["distill=kl", "distill_alpha=1"], "'distill_alpha': 1.0 .* distill=kl would ignore it"),
                     # was accepted: 0.5 equalled the default, so an explicit value went unnoticed
                     (["distill=kl", "distill_alpha=0.5"], "'distill_alpha': 0.5 .* distill=kl would ignore it")):
        with pytest.raises(ConfigError, match=msg):
            load(None, ["target=t", "train=x", *bad])


def test_resume_accepts_an_old_checkpoint_with_the_old_alpha_default(tmp_path):
    """Checkpoints saved while distill_alpha defaulted to 0.5 hold 0.5 with ce/kl: still the same run."""
    from train.config import save
    from train.distill import check_resumed_config

    cfg = load(None, ["target=t", "train=x"])
    old = load(None, ["target=t", "train=x"])
    old.distill_alpha = 0.5  # bypasses validate, as the old default did
    save(old, tmp_path)
    check_resumed_config(tmp_path, cfg)  # no error
    save(load(None, ["target=t", "train=x", "distill=mix", "distill_alpha=0.5"]), tmp_path)
    with pytest.raises(ConfigError, match=r"distill: 'mix' -> 'ce'; distill_alpha: 0.5 -> None"):
        check_resumed_config(tmp_path, cfg)


def test_target_last_hidden_gives_the_target_logits(stories_dir):
    from dspine.target import load_target

    target = load_target(str(stories_dir), dtype="fp32")
    target.set_layer_ids([0, 2])
    ids = torch.tensor([[1, 45, 300, 12, 7, 99, 3]])
    feats, last = target.features_and_last_hidden(ids)
    assert torch.equal(feats, target.features(ids))
    with torch.no_grad():
        ref = target.model(input_ids=ids).logits
        got = target.lm_head(target.final_norm(last))
    assert (got - ref).abs().max() < 1e-5 and ref.abs().max() > 1.0


# ------------------------------------------------------------------------------------- trainer

COMMON = ("max_steps=24", "save_every=12", "eval_every=12", "log_every=1", "anchors_per_seq=16", "max_length=40",
          "keep_last=0", "eval_prompts=1", "eval_max_new_tokens=8", "eval_max_rows=8", "warmup_ratio=0",
          "distill=kl")


@pytest.fixture(scope="module")
def kd_data(tmp_path_factory, stories_dir):
    root = tmp_path_factory.mktemp("kd_data")
    for name, num, seed in (("train", 96, 0), ("eval", 8, 1)):
        assert sample_main(["--target", str(stories_dir), "--num", str(num), "--max-new-tokens", "32", "--seed",
                            str(seed), "--batch-size", "96", "--temperature", "1.0",
                            "--out", str(root / f"{name}.jsonl")]) == 0
    return [f"target={stories_dir}", f"train={root / 'train.jsonl'}", f"eval={root / 'eval.jsonl'}"]


CONFIG_ARGS = ("--config", str(REPO / "configs" / "stories260k-cpu.yaml"))


def run_distill(*overrides: str) -> None:
    import subprocess

    r = subprocess.run([sys.executable, str(REPO / "train" / "distill.py"), "--config",
                        str(REPO / "configs" / "stories260k-cpu.yaml"), *overrides],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-6000:]


def jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_trainer_with_kl_learns_and_resumes_exactly(kd_data, tmp_path):
    from tests.helpers import distill_cases

    straight, split = tmp_path / "straight", tmp_path / "split"
    # the 24 straight steps and the first 12 of the split run one after the other in one child process (one torch
    # start); the resume below is a new process
    runs = distill_cases([[*CONFIG_ARGS, *kd_data, *COMMON, f"output_dir={straight}"],
                          [*CONFIG_ARGS, *kd_data, *COMMON, f"output_dir={split}", "stop_after_steps=12"]])
    for r in runs:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-6000:]
    rows = jsonl(straight / "metrics.jsonl")
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in train] == list(range(1, 25)) and [r["step"] for r in evals] == [12, 24]
    first, last = sum(r["train/kl"] for r in train[:3]) / 3, sum(r["train/kl"] for r in train[-3:]) / 3
    assert last < 0.8 * first  # the KL to the target falls
    for r in train:  # the objective is CE(p, q) = KL + H(p) >= KL
        assert r["loss"] >= r["train/kl"] > 0 and len(r["train/argmax_agree_at_pos"]) == 7
    assert evals[1]["eval/kl"] < evals[0]["eval/kl"]
    assert evals[1]["eval/ce"] < evals[0]["eval/ce"] and 0 < sum(evals[1]["eval/argmax_agree_at_pos"]) < 7
    assert 1.0 <= evals[1]["eval/tau_sim_agree"] <= 8 and "eval/tau_real" in evals[1]
    # T > 0 proxy: the sampling overlap per slot in (0, 1) and tau_sim of it; train rows do not carry it
    from train.loss import tau_sim

    for e in evals:
        assert all(0 < x < 1 for x in e["eval/overlap_at_pos"]) and len(e["eval/overlap_at_pos"]) == 7
        assert e["eval/tau_sim_sample"] == pytest.approx(tau_sim(e["eval/overlap_at_pos"])[0], rel=1e-12)
        assert 1.0 < e["eval/tau_sim_sample"] < 8.0
    assert not any("overlap" in k for r in train for k in r)
    # resume: 12 steps, stop (above), resume == 24 straight steps, bitwise
    run_distill(*kd_data, *COMMON, f"output_dir={split}")
    a, b = jsonl(straight / "metrics.jsonl"), jsonl(split / "metrics.jsonl")
    key = lambda rows, k: [r.get(k) for r in rows if "loss" in r]
    for k in ("loss", "grad_norm", "train/kl", "train/argmax_agree_at_pos"):
        assert key(a, k) == key(b, k)
    # the distill mode is part of the exact continuation: switching it on resume is refused
    import subprocess

    r = subprocess.run([sys.executable, str(REPO / "train" / "distill.py"), "--config",
                        str(REPO / "configs" / "stories260k-cpu.yaml"), *kd_data, *COMMON[:-1], "distill=ce",
                        "max_steps=30", f"output_dir={split}"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and "distill: 'kl' -> 'ce'" in r.stderr


def test_ab_summary_compares_the_last_evals(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("ab_summary", REPO / "scripts" / "smollm2" / "ab_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ab_main = module.main

    def fake_run(name, tau, kl, with_eval=True):
        d = tmp_path / name
        d.mkdir()
        rows = [{"step": 5, "loss": 2.0, "step_s": 0.3, "tokens_per_s": 1000.0},
                {"step": 10, "loss": 1.5, "step_s": 0.5, "tokens_per_s": 800.0}]
        if with_eval:
            rows += [{"step": 5, "eval/loss": 2.5, "eval/tau_real": 1.1, "eval/tau_sim": 1.2},
                     {"step": 10, "eval/loss": 2.0, "eval/tau_real": tau, "eval/tau_sim": 1.5, "eval/kl": kl,
                      "eval/acc_at_pos": [0.5, 0.25]}]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "config.json").write_text(json.dumps({"distill": name, "seed": 0}))
        return f"{name}={d}"

    out = tmp_path / "ab.json"
    assert ab_main(["--run", fake_run("ce", 1.5, 0.9), "--run", fake_run("kl", 1.75, 0.6), "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    d = rep["delta"]["kl-ce"]
    assert d["tau_real"] == pytest.approx(0.25) and d["kl"] == pytest.approx(-0.3) and d["tau_sim"] == 0.0
    assert d["tau_sim_agree"] is None and rep["runs"]["kl"]["config"]["distill"] == "kl"
    assert rep["runs"]["ce"]["step_s_median"] == pytest.approx(0.4) and rep["runs"]["ce"]["steps"] == 10
    assert rep["runs"]["kl"]["evals"][-1]["acc_at_pos"] == [0.5, 0.25]
    assert ab_main(["--run", fake_run("ce2", 1.5, 0.9), "--run", fake_run("none", 0, 0, False),
                    "--out", str(out)]) == 1  # a run without an eval row is an error (after writing the JSON)

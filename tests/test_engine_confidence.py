"""The planner's confidence input (``Engine(budget="auto")``): the draft's chain confidence written by the
speculative steps (``dspine.ops.plan_stats.chain_confidence``), and the planner loop passing it to ``choose``."""

from __future__ import annotations

import pytest
import torch

from dspine.reference import ReferenceDecoder
from dspine.sampling import SamplingParams
from infer import engine as engine_mod
from tests.helpers import oracle_engine
from tests.test_engine import PROMPTS, _engine
from tests.test_engine_tree import stories  # noqa: F401 (module fixture: target + random block-8 draft)


def _admitted(stories_dir, folder, params, mode, B=4, **kw):
    """An auto-budget engine with PROMPTS[:B] prefilled into slots 0..B-1 and the step of ``mode`` built
    before (a CUDA graph capture resets the slots); (engine, slots, draft cache, step)."""
    eng = _engine(stories_dir, folder, budget="auto", **kw)
    s = eng._slots_for(B)
    kv, dcache = eng._cache_view(B)
    step = eng._runner(B, params, True, mode)
    eng.slot_owner = list(range(B))
    eng._admit(s, list(enumerate(PROMPTS[:B])), params, True, kv, dcache, [11 + b for b in range(B)])
    return eng, s, dcache, step


def _reference(d_logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """1 + Σ_k Π_{j≤k} p_j with p_j = softmax(logits / T)[token j] (plain temperature), by loops."""
    p = torch.softmax(d_logits.double() / temperature, -1).gather(-1, tokens[..., None])[..., 0]
    out = []
    for row in p.tolist():
        total, prod = 1.0, 1.0
        for x in row:
            prod *= x
            total += prod
        out.append(total)
    return torch.tensor(out, dtype=torch.float64)


def _check_confidence(stories_dir, folder, temperature, **kw):
    params = SamplingParams(temperature=temperature, max_new_tokens=30, seed=5)
    got = {}
    for mode in (("chain", 8), ("tree", 32)):
        eng, s, dcache, step = _admitted(stories_dir, folder, params, mode, **kw)
        s.draft_block[:, 0] = s.anchor
        d_logits = eng.draft_logits(s.draft_block, dcache).float()  # [B, 7, V], the step recomputes it
        step()
        if mode[0] == "chain":
            tokens = s.verify_block[:, 1:].clone()  # the draft's own tokens of this step
            if temperature == 0:
                assert torch.equal(tokens, d_logits.argmax(-1))
        got[mode] = s.conf.clone()
        want = _reference(d_logits, tokens, temperature if temperature > 0 else 1.0)
        if temperature == 0:  # the max probability
            want = _reference(d_logits, d_logits.argmax(-1), 1.0)
        assert torch.allclose(got[mode].double().cpu(), want, rtol=1e-5, atol=1e-6), (mode, got[mode], want)
    assert torch.allclose(got[("chain", 8)], got[("tree", 32)], rtol=1e-6)  # the tree's chain: same tokens
    # an untrained draft over 512 tokens is unsure: near 1 (nothing expected accepted beyond the bonus)
    assert 1.0 <= float(got[("chain", 8)].max()) < 1.3, got


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_confidence_buffer_equals_reference(stories_dir, stories, temperature):  # noqa: F811
    """Chain step and tree step write the same chain confidence, equal to a float64 reference from the
    draft's own logits and its chosen tokens (argmax at T = 0, the sampled ones at T = 1)."""
    _check_confidence(stories_dir, stories[2], temperature)


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_confidence_buffer_in_the_cuda_graph(stories_dir, stories, temperature):  # noqa: F811
    """The same on a GPU with the steps replayed as CUDA graphs (the buffer is written inside the graph)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _check_confidence(stories_dir, stories[2], temperature, device="cuda", cuda_graphs=True)


def test_confidence_of_an_oracle_draft_is_near_the_block(stories_dir, stories):  # noqa: F811
    """One-hot logits of 10 over 512 tokens: p = e^10 / (e^10 + 511) per slot, 7 slots."""
    target, _, folder = stories
    params = SamplingParams(max_new_tokens=10)  # one step of 8: the reference needs 10 tokens
    want = ReferenceDecoder(target, None, [2]).generate(PROMPTS[:4], params).token_ids
    eng, s, _, step = _admitted(stories_dir, folder, params, ("chain", 8))
    oracle_engine(eng, [p + w for p, w in zip(PROMPTS, want)], corrupt=0.0)
    step()  # eager on the CPU: the lambda calls the patched draft_logits
    p = torch.tensor(10.0).exp() / (torch.tensor(10.0).exp() + 511)
    expected = 1 + sum(float(p) ** k for k in range(1, 8))  # 7.38 of the block's 8
    assert torch.allclose(s.conf, torch.full((4,), expected), rtol=1e-5), s.conf
    assert torch.equal(s.hist[:, 8], torch.ones(4, dtype=torch.int32))  # all 7 accepted + bonus


def test_planner_loop_receives_the_confidence(stories_dir, stories, monkeypatch):  # noqa: F811
    """--budget auto with a half-corrupted oracle draft: every choice two after a speculative step (the loop is
    pipelined) gets the mean confidence of the rows live in it (one value for every speculative mode), none
    two after an AR step;
    the report has calibration factors (realized < predicted: the corrupted slots were confident too); the
    greedy output is the target's, as with the planner given no confidence."""
    target, _, folder = stories
    params = SamplingParams(max_new_tokens=24)
    prompts = PROMPTS[:4]
    want = _engine(stories_dir, folder).generate(prompts, params, use_draft=False).token_ids  # the engine's AR
    seen = []
    choose = engine_mod.StepPlanner.choose

    def spy(self, predicted=None, drain=None, kv=None):
        mode = choose(self, predicted, drain)
        seen.append((predicted, mode))
        return mode

    monkeypatch.setattr(engine_mod.StepPlanner, "choose", spy)
    outputs = {}
    for with_conf in (True, False):
        eng = oracle_engine(_engine(stories_dir, folder, budget="auto"), [p + w for p, w in zip(prompts, want)],
                            corrupt=0.3)
        eng.plan_modes = eng.plan_modes[:2] + [("tree", 24)]
        eng._step_costs = lambda B, params: {("ar", 1): 0.6, ("chain", 8): 1.0, ("tree", 24): 1.0}
        eng.plan_online = False
        if not with_conf:
            monkeypatch.setattr(engine_mod.StepPlanner, "choose", lambda self, predicted=None, drain=None, kv=None: choose(self, None, drain))
        seen.clear()
        res = eng.generate(prompts, params, concurrency=2)
        outputs[with_conf] = res.token_ids
        if with_conf:
            rep = eng.planner_report
            given = [(p, m) for p, m in seen if p is not None]
            assert len(given) >= 5, seen
            for p, _ in given:
                assert set(p) == {("chain", 8), ("tree", 24)} and len(set(p.values())) == 1
                assert 1.0 <= p[("chain", 8)] <= 8.0
            # the loop observes step k - 1 after launching step k, so choice k + 1 gets step k - 1's confidence:
            # nothing two choices after an AR step, nor for the first two choices
            assert seen[0][0] is None and seen[1][0] is None, seen
            assert all(p is None for (p, _), (_, prev) in zip(seen[2:], seen[:-2]) if prev[0] == "ar"), seen
            ran = [k for k in ("chain8", "tree24") if rep[k]["steps"] >= 3]
            assert ran and all(rep[k]["calibration"] is not None and 0 < rep[k]["calibration"] < 1 for k in ran), rep
    assert outputs[True] == outputs[False] == want


def test_planner_gets_the_confidence_at_t0_only_by_default(stories_dir, stories, monkeypatch):  # noqa: F811
    """``Engine.plan_confidence``: "greedy" (default) gives the chain confidence at T = 0 and none at T > 0,
    "always" at any temperature, "never" none."""
    target, _, folder = stories
    given = []
    choose = engine_mod.StepPlanner.choose

    def spy(self, predicted=None, drain=None, kv=None):
        given.append(predicted is not None)
        return choose(self, predicted, drain)

    monkeypatch.setattr(engine_mod.StepPlanner, "choose", spy)
    for temperature, setting, want in ((0.0, "greedy", True), (1.0, "greedy", False), (1.0, "always", True),
                                       (0.0, "never", False)):
        # the full chain and the trees only: a narrower chain gives no confidence (test_engine_chains.py)
        eng = _engine(stories_dir, folder, budget="auto", plan_chains=())
        eng._step_costs = lambda B, params, modes=eng.plan_modes: {m: 1.0 + 0.1 * (m[0] != "ar") for m in modes}
        eng.plan_online, eng.plan_confidence = False, setting
        given.clear()
        eng.generate(PROMPTS[:2], SamplingParams(temperature=temperature, max_new_tokens=24, seed=1), concurrency=2)
        assert any(given) == want, (temperature, setting, given)


def test_planner_loop_times_each_step_as_its_own_mode(stories_dir, stories, monkeypatch):  # noqa: F811
    """The pipelined planner loop observes step k after launching step k + 1; on the CPU a step runs inside its
    launch call, so each observed time must be the launch-to-launch interval of that step's own mode (the loop
    once charged the next step's time to it). AR steps are slowed by 20 ms and chain steps by 400 ms: every
    timed chain step measures at least 400 ms and every timed AR step less (a loaded CPU adds some to both)."""
    import time

    target, _, folder = stories
    params = SamplingParams(max_new_tokens=16)
    prompts = PROMPTS[:3]
    want = _engine(stories_dir, folder).generate(prompts, params, use_draft=False).token_ids
    eng = oracle_engine(_engine(stories_dir, folder, budget="auto"), [p + w for p, w in zip(prompts, want)],
                        corrupt=0.0)
    eng.plan_modes = eng.plan_modes[:2]  # AR and the chain
    eng._step_costs = lambda B, params: {("ar", 1): 0.6, ("chain", 8): 1.0}
    runner = eng._runner

    def slowed(B, params, spec, mode=None):
        run = runner(B, params, spec, mode)
        pause = 0.02 if mode == ("ar", 1) else 0.4
        return lambda: (time.sleep(pause), run())

    monkeypatch.setattr(eng, "_runner", slowed)
    seen = []
    observe = engine_mod.StepPlanner.observe

    def spy(self, mode, tokens, ms=None, rows=1, kv=None):
        seen.append((mode, ms))
        return observe(self, mode, tokens, ms, rows)

    monkeypatch.setattr(engine_mod.StepPlanner, "observe", spy)
    res = eng.generate(prompts, params, concurrency=2)
    assert res.token_ids == want
    ar = [ms for m, ms in seen if m == ("ar", 1) and ms is not None]
    chain = [ms for m, ms in seen if m == ("chain", 8) and ms is not None]
    assert len(ar) >= 3 and chain, seen  # AR's 3 timings first, then the chain (8 tokens a step) wins
    assert max(ar) < 400 <= min(chain), seen


def test_graph_capture_mid_decode_is_refused(stories_dir, stories, monkeypatch):  # noqa: F811
    """A CUDA-graph capture empties the slots (warm-up on idle rows): mid-decode it would overwrite the live rows'
    state and KV cache, so _runner refuses it with the slots it would clobber, before touching CUDA."""
    folder = stories[2]
    greedy = SamplingParams(max_new_tokens=8)
    eng, s, _, _ = _admitted(stories_dir, folder, greedy, ("chain", 8), B=4)
    lengths = s.lengths.clone()
    eng.cuda_graphs = True  # the capture path (on the CPU it would fail in torch.cuda: the guard comes first)
    with pytest.raises(RuntimeError, match=r"requested while requests are decoding \(slots \[0, 1, 2, 3\]\)"):
        eng._runner(4, greedy, True, ("tree", 32))
    assert torch.equal(s.lengths, lengths) and not bool(s.done.any())  # nothing was reset
    eng.slot_owner = [None] * 4  # every request finished: a capture may empty the slots again
    monkeypatch.setattr(engine_mod.torch.cuda, "Stream", lambda: (_ for _ in ()).throw(AssertionError("capture")))
    with pytest.raises(AssertionError, match="capture"):  # got past the guard, into the capture
        eng._runner(4, greedy, True, ("tree", 32))


def test_cost_table_follows_plan_modes(stories_dir, stories):  # noqa: F811
    """The start-up cost table is cached per plan_modes: a mode added afterwards is timed (and its graph made)
    before the next decode admits, not first built mid-decode."""
    folder = stories[2]
    eng = _engine(stories_dir, folder, budget="auto")
    greedy = SamplingParams(max_new_tokens=8)
    eng.plan_modes = [("ar", 1)]
    assert set(eng._step_costs(2, greedy)) == {("ar", 1)}
    eng.plan_modes = [("ar", 1), ("chain", eng.verify_size)]
    assert set(eng._step_costs(2, greedy)) == {("ar", 1), ("chain", eng.verify_size)}


def test_planner_leaves_out_the_tree_that_is_the_chain(stories_dir, stories):  # noqa: F811
    """A chain-first tree (T > 0, or ``tree_chain_first=True``) of verify_size nodes holds the chain's tokens alone:
    the planner's table, its decode and its report go without it (Engine.planner_modes); a smaller one (a shorter
    chain) stays, and best-first trees (T = 0) keep every size. The cost table is keyed by the run's modes, so a
    table made with the chain first is not reused without it."""
    eng = _engine(stories_dir, stories[2], budget="auto", plan_trees=(6, 8, 12))
    greedy = SamplingParams(max_new_tokens=6)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=6, seed=1)
    assert eng.verify_size == 8
    chains = [("chain", 2), ("chain", 4), ("chain", 8)]  # the default narrower chains stay: they are not trees
    assert eng.planner_modes(greedy) == [("ar", 1), *chains, ("tree", 6), ("tree", 8), ("tree", 12)]
    assert eng.planner_modes(sampled) == [("ar", 1), *chains, ("tree", 6), ("tree", 12)]
    assert set(eng._step_costs(2, sampled)) == {("ar", 1), *chains, ("tree", 6), ("tree", 12)}
    # draft temperature 0 at T > 0: a one-hot draft's tree is the chain and padding, refused as a fixed mode; the
    # planner leaves every tree out (newcomer review: it listed and could run the tree of 32)
    one_hot = SamplingParams(temperature=1.0, max_new_tokens=6, seed=1, draft_temperature=0.0)
    assert eng.planner_modes(one_hot) == [("ar", 1), *chains]
    res = eng.generate(PROMPTS[:2], one_hot, concurrency=2)
    assert set(eng.planner_report) == {"ar", "chain2", "chain4", "chain8"}
    assert sum(e["steps"] for e in eng.planner_report.values()) == res.steps
    res = eng.generate(PROMPTS[:2], sampled, concurrency=2)
    assert set(eng.planner_report) == {"ar", "chain2", "chain4", "chain8", "tree6", "tree12"}
    assert sum(e["steps"] for e in eng.planner_report.values()) == res.steps
    eng.tree_chain_first = True
    assert eng.planner_modes(greedy) == [("ar", 1), *chains, ("tree", 6), ("tree", 12)]
    eng.generate(PROMPTS[:2], greedy, concurrency=2)
    assert set(eng.planner_report) == {"ar", "chain2", "chain4", "chain8", "tree6", "tree12"}
    eng.tree_chain_first = None  # best first again: the tree of 8 is back, with a table of its own
    eng.plan_schedule = [("chain", 8), ("tree", 8)]
    eng.generate(PROMPTS[:2], greedy, concurrency=2)
    assert eng.planner_report["tree8"]["steps"] >= 2
    with pytest.raises(ValueError, match=r"outside this run's planner modes .*\('tree', 12\)\]"):
        eng.generate(PROMPTS[:2], sampled, concurrency=2)


def _check_chain_accepted(stories_dir, folder, temperature, oracle=None, **kw):
    """One tree step writes into ``chain_acc`` what one chain step from the same state accepts (same draft
    block, same seeds): the planner's paired observation (``infer.planner``, "Paired observations").
    ``oracle = (target, corrupt)``: the draft is the greedy continuation with a fraction ``corrupt`` of its
    slots wrong (eager engines only), so the chain stops at varied depths. Returns the counts compared."""
    params = SamplingParams(temperature=temperature, max_new_tokens=30, seed=5)
    if oracle is not None:
        want = ReferenceDecoder(oracle[0], None, [2]).generate(PROMPTS[:4], SamplingParams(max_new_tokens=40))
        reference = [p + w for p, w in zip(PROMPTS, want.token_ids)]
    committed, tokens = {}, {}
    for mode in (("chain", 8), ("tree", 16), ("tree", 32)):
        eng, s, _, step = _admitted(stories_dir, folder, params, mode, **kw)
        if oracle is not None:
            oracle_engine(eng, reference, corrupt=oracle[1], seed=3)
        before = s.out_len.clone()
        s.chain_acc.fill_(-1)  # a step that does not write it fails below
        s.inner_acc.fill_(-1)
        step()
        committed[mode] = (s.out_len - before).cpu()
        tokens[mode] = [s.out_tokens[b, int(before[b]) : int(s.out_len[b])].tolist() for b in range(s.B)]
        if mode == ("tree", 32):
            got, inner = s.chain_acc.cpu(), s.inner_acc[0].cpu()  # the tree of 16 inside the tree of 32
    rows = [b for b in range(len(got)) if 2 not in tokens[("chain", 8)][b]]  # no EOS cut the chain's commit
    assert len(rows) >= 3
    chain_a = committed[("chain", 8)] - 1  # accepted draft tokens of the chain step
    assert torch.equal(got[rows], chain_a[rows].to(got.dtype)), (got, chain_a)
    assert bool((committed[("tree", 32)][rows] >= committed[("chain", 8)][rows]).all())
    # the planner's smaller tree, counted in the same launch (dspine.ops.plan_stats): at T = 0 what the tree of 16
    # accepts from the same state (its nodes are the tree of 32's first 16 by rank, dspine.tree.inner_accepted); at
    # T > 0 a draw of it, so only bounded by the run tree's
    rows16 = [b for b in rows if 2 not in tokens[("tree", 16)][b]]
    if temperature == 0:
        assert len(rows16) >= 3
        want = (committed[("tree", 16)] - 1).to(inner.dtype)
        assert torch.equal(inner[rows16], want[rows16]), (inner, want)
    assert bool(((inner >= 0) & (inner <= committed[("tree", 32)].to(inner.dtype) - 1))[rows].all()), inner
    return got[rows]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tree_step_counts_what_the_chain_step_accepts(stories_dir, stories, temperature):  # noqa: F811
    got = _check_chain_accepted(stories_dir, stories[2], temperature, oracle=(stories[0], 0.3))
    assert len(set(got.tolist())) >= 2 and int(got.max()) >= 2, got  # the chain stopped at varied depths


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("graphs", [True, False])
def test_tree_step_counts_the_chain_on_the_gpu(stories_dir, stories, temperature, graphs):  # noqa: F811
    """The same with the Triton kernels: inside the tree step's CUDA graph (the untrained draft: the count
    is written there, here 0), and eagerly with the oracle draft (varied counts)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    oracle = None if graphs else (stories[0], 0.3)
    _check_chain_accepted(stories_dir, stories[2], temperature, oracle, device="cuda", impl="triton",
                          cuda_graphs=graphs)


def test_tree_step_counts_the_chain_with_the_triton_kernels_interpreted(stories_dir, stories):  # noqa: F811
    """The same through the Triton kernels in the interpreter (CPU, T = 0; about 30 s): the tree step's one-launch
    bookkeeping (``dspine.ops.plan_stats``: confidence and chain count) and the chain step's, with the oracle
    draft."""
    import tests.kernel_env as env

    if not env.TRITON_CPU:
        pytest.skip(str(env.TRITON_CPU_SKIP))
    got = _check_chain_accepted(stories_dir, stories[2], 0.0, oracle=(stories[0], 0.3), impl="triton")
    assert len(set(got.tolist())) >= 2, got


def test_planner_state_rows_kv_gets_the_live_requests_context_tokens(stories_dir, stories, monkeypatch):  # noqa: F811
    """Engine.plan_state="kv" / "rows_kv": every choice and observation gets every slot's context tokens (prompt +
    committed; here every slot's request is live until it finishes). The first choice's are the prompts' plus their first tokens; between two observations of the same
    live requests they grow by what the first committed (tokens per request × requests); the output stays AR's."""
    _, _, folder = stories
    params = SamplingParams(max_new_tokens=16)
    prompts = PROMPTS[:3]
    want = _engine(stories_dir, folder).generate(prompts, params, use_draft=False).token_ids
    eng = _engine(stories_dir, folder, budget="auto")
    eng.plan_state = "kv"
    chosen, seen = [], []
    choose, observe = engine_mod.StepPlanner.choose, engine_mod.StepPlanner.observe

    def spy_choose(self, predicted=None, drain=None, kv=None):
        chosen.append(kv)
        return choose(self, predicted, drain, kv)

    def spy_observe(self, mode, tokens, ms=None, rows=1, kv=None):
        seen.append((tokens, rows, kv))
        return observe(self, mode, tokens, ms, rows, kv)

    monkeypatch.setattr(engine_mod.StepPlanner, "choose", spy_choose)
    monkeypatch.setattr(engine_mod.StepPlanner, "observe", spy_observe)
    assert eng.generate(prompts, params, concurrency=3).token_ids == want
    assert chosen[0] == seen[0][2] == sum(len(p) + 1 for p in prompts) and seen[0][1] == 3
    same = [(a, b) for a, b in zip(seen, seen[1:]) if a[1] == b[1]]
    assert len(same) >= 3
    for (tokens, rows, kv), (_, _, kv_next) in same:
        assert kv_next == pytest.approx(kv + tokens * rows)

"""The engine with tree verification (``Engine(verify="tree")``): lossless greedy output, seeded sampling."""

from __future__ import annotations

import re

import pytest
import torch

from dspine.checkpoint import save_draft
from dspine.reference import ReferenceDecoder
from dspine.sampling import SamplingParams
from dspine.target import load_target
from tests.helpers import random_draft
from tests.test_engine import PROMPTS, _engine


@pytest.fixture(scope="module")
def stories(stories_dir, tmp_path_factory):
    """The stories260K target (fp32) and an untrained block-8 draft saved to a folder."""
    target = load_target(str(stories_dir), dtype="fp32")
    return (
        target,
        None,
        save_draft(random_draft(target, block_size=8, mask=0), tmp_path_factory.mktemp("draft")),
    )


def second_choice_engine(engine, reference: list[list[int]], seed: int = 0):
    """Patch the engine's draft: the true next token gets logit 9 at every slot and, with probability
    1/2, a random wrong token gets 10 (the argmax): a chain stops there, a tree holds the true token."""
    g = torch.Generator().manual_seed(seed)
    V = engine.target.args.vocab_size

    def draft_logits(block, cache, width=None):  # width: a planner chain's, narrower than the block (sliced by it)
        B, bs = block.shape
        logits = torch.zeros(B, bs - 1, V)
        for b in range(B):
            owner = engine.slot_owner[b]
            seq = reference[owner] if owner is not None else []
            start = int(cache.lengths[b])
            for k in range(1, bs):
                logits[b, k - 1, seq[start + k] if start + k < len(seq) else 0] = 9.0
                if torch.rand(1, generator=g) < 0.5:
                    logits[b, k - 1, int(torch.randint(0, V, (1,), generator=g))] = 10.0
        return logits.to(engine.device, engine.target.embed.dtype)

    engine.draft_logits = draft_logits
    return engine


def test_engine_tree_greedy_equals_chain(stories_dir, stories):
    target, _, folder = stories
    params = SamplingParams(max_new_tokens=40)
    want = ReferenceDecoder(target, None, [2]).generate(PROMPTS, params).token_ids
    chain = _engine(stories_dir, folder).generate(PROMPTS, params, concurrency=3)
    tree = _engine(stories_dir, folder, verify="tree", tree_budget=20).generate(
        PROMPTS, params, concurrency=3
    )
    assert chain.token_ids == want and tree.token_ids == want
    ref = [p + w for p, w in zip(PROMPTS, want)]
    taus = {}
    for verify in ("chain", "tree"):
        eng = second_choice_engine(_engine(stories_dir, folder, verify=verify, tree_budget=24), ref)
        res = eng.generate(PROMPTS, params, concurrency=4)
        assert res.token_ids == want, verify
        assert abs(res.stats.tau - 1 - sum(res.stats.accept_at_pos)) < 1e-12
        taus[verify] = res.stats.tau
    assert taus["chain"] < 2.5 and taus["tree"] > taus["chain"] + 1.5, taus
    with pytest.raises(ValueError, match="tree_budget in 2..64"):
        _engine(stories_dir, folder, verify="tree", tree_budget=65)
    with pytest.raises(ValueError, match="verify='beam'"):
        _engine(stories_dir, folder, verify="beam")


@pytest.mark.parametrize("budget", [2, 5])
def test_engine_tree_budget_below_the_block(stories_dir, stories, budget):
    """A tree of fewer nodes than the block's slots (N - 1 < K = 7) is at most N - 1 deep: the accepted path,
    its K/V move and the committed tokens stay within the N nodes (an index error before the fix), output
    lossless, accept lengths capped at N - 1."""
    target, _, folder = stories
    params = SamplingParams(max_new_tokens=40)
    want = ReferenceDecoder(target, None, [2]).generate(PROMPTS, params).token_ids
    eng = second_choice_engine(_engine(stories_dir, folder, verify="tree", tree_budget=budget),
                               [p + w for p, w in zip(PROMPTS, want)])
    res = eng.generate(PROMPTS, params, concurrency=3)
    assert res.token_ids == want
    hist = res.stats.hist  # hist[n]: steps that committed n tokens (n - 1 drafted tokens accepted + the bonus)
    assert sum(hist[budget + 1 :]) == 0 and sum(hist[2 : budget + 1]) > 0  # 1..N-1 accepted, never more


def test_engine_tree_rule_by_temperature_and_its_refusals(stories_dir, stories):
    """tree_chain_first: None builds best first at T = 0 and chain first at T > 0 and with force_accept; every rule
    is lossless at T = 0 (the second-choice draft's trees differ between the rules); False is refused at T > 0 and
    with force_accept, a non-bool at construction."""
    target, _, folder = stories
    params = SamplingParams(max_new_tokens=30)
    want = ReferenceDecoder(target, None, [2]).generate(PROMPTS, params).token_ids
    full = [p + w for p, w in zip(PROMPTS, want)]
    hot = SamplingParams(temperature=1.0, max_new_tokens=4)
    taus = {}
    for rule in (None, True, False):
        eng = second_choice_engine(_engine(stories_dir, folder, verify="tree", tree_budget=6, tree_chain_first=rule), full)
        assert eng.chain_first(params) is (rule is True)
        if rule is not False:
            assert eng.chain_first(hot) is True
        res = eng.generate(PROMPTS, params, concurrency=3)
        assert res.token_ids == want, rule
        taus[rule] = res.stats.tau
    assert taus[None] == taus[False] and taus[False] != taus[True]
    eng = _engine(stories_dir, folder, verify="tree", tree_budget=6, tree_chain_first=False)
    with pytest.raises(ValueError, match="tree_chain_first=False at temperature 1.0"):
        eng.generate(PROMPTS[:1], hot)
    eng.force_accept = 2  # a benchmark setting (bench_tree's oracle steps)
    with pytest.raises(ValueError, match="with force_accept"):
        eng.generate(PROMPTS[:1], params)
    eng.tree_chain_first = None
    assert eng.chain_first(params) is True
    with pytest.raises(ValueError, match="tree_chain_first=1 must be None, True or False"):
        _engine(stories_dir, folder, verify="tree", tree_budget=6, tree_chain_first=1)


def test_engine_tree_sampling_is_seeded_per_request(stories_dir, stories):
    """T > 0: a prompt's output depends only on its seed, not on the concurrency (rows are independent)."""
    eng = _engine(stories_dir, stories[2], verify="tree", tree_budget=12)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=40, max_new_tokens=20, seed=3)
    one = eng.generate(PROMPTS[:4], p, concurrency=1)
    four = eng.generate(PROMPTS[:4], p, concurrency=4)
    assert one.token_ids == four.token_ids and all(len(t) == 20 or t[-1] == 2 for t in one.token_ids)
    assert abs(four.stats.tau - 1 - sum(four.stats.accept_at_pos)) < 1e-12


@pytest.mark.slow
def test_engine_tree_triton_kernels_interpreted(stories_dir, stories):
    """Tree verify through the Triton kernels (interpreter on the CPU) gives the greedy output."""
    import tests.kernel_env as env

    if not env.TRITON_CPU:
        pytest.skip(str(env.TRITON_CPU_SKIP))
    target, _, folder = stories
    prompts = PROMPTS[:2]
    params = SamplingParams(max_new_tokens=12)
    want = ReferenceDecoder(target, None, [2]).generate(prompts, params).token_ids
    ref = [p + w for p, w in zip(prompts, want)]
    eng = second_choice_engine(
        _engine(stories_dir, folder, impl="triton", verify="tree", tree_budget=16), ref
    )
    res = eng.generate(prompts, params, concurrency=2)
    assert res.token_ids == want and res.stats.tau > 1.5


@pytest.mark.slow
def test_engine_tree_sampling_triton_kernels_interpreted(stories_dir, stories):
    """T > 0 tree verify through the Triton kernels (interpreter on the CPU: the fused tree builder and the fused
    sampling verify) emits the torch path's tokens and acceptance counts for the same seeds (the kernels' fp64
    sums can part from torch's fp32 only at near-ties, which this draft does not produce)."""
    import tests.kernel_env as env

    if not env.TRITON_CPU:
        pytest.skip(str(env.TRITON_CPU_SKIP))
    target, _, folder = stories
    prompts = PROMPTS[:2]
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=40, max_new_tokens=6, seed=5)  # interpreted steps: seconds
    # a draft that proposes this very sample (the target's own draws: often accepted) beside a random wrong argmax
    want = ReferenceDecoder(target, None, [2]).generate(prompts, p).token_ids
    ref = [q + w for q, w in zip(prompts, want)]
    runs = [second_choice_engine(_engine(stories_dir, folder, impl=impl, verify="tree", tree_budget=12), ref, seed=1)
            .generate(prompts, p, concurrency=2) for impl in ("torch", "triton")]
    assert runs[1].token_ids == runs[0].token_ids and all(len(t) == p.max_new_tokens or t[-1] == 2
                                                          for t in runs[0].token_ids)
    assert runs[1].stats.hist == runs[0].stats.hist and runs[0].stats.tau > 1.5, (runs[0].stats.hist, runs[0].stats.tau)


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_bench_and_generate_verify_tree_on_the_cpu(stories_dir, stories, tmp_path, backend, capsys):
    import json

    from infer import bench, generate
    from tests.conftest import shared_path

    folder, out = stories[2], tmp_path / "b.json"
    extra = ["--device", "cpu"] if backend == "cuda" else []
    code = bench.main(
        [
            "--target",
            str(stories_dir),
            "--draft",
            f"T={folder}",
            "--datasets",
            "gsm8k",
            "--data-dir",
            str(shared_path("data", "eval")),
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "10",
            "--no-chat-template",
            "--backend",
            backend,
            "--dtype",
            "fp32",
            "--concurrency",
            "2",
            "--verify",
            "tree",
            "--tree-budget",
            "12",
            "--output-json",
            str(out),
            *extra,
        ]
    )
    assert code == 0
    d = json.loads(out.read_text())["tasks"][0]["drafts"]["T"]
    assert d["verify"] == "tree" and d["verified_tokens_per_step"] == 12
    assert d["greedy_equal"] == d["greedy_compared"] == 2  # fp32: lossless
    assert "12 verified tokens per step" in capsys.readouterr().out
    if backend == "reference":  # infer.generate runs the engine only on a GPU
        assert (
            generate.main(
                [
                    "--target",
                    str(stories_dir),
                    "--draft",
                    str(folder),
                    "--prompt",
                    "Once",
                    "--no-chat-template",
                    "--max-new-tokens",
                    "8",
                    "--verify",
                    "tree",
                    "--tree-budget",
                    "6",
                    "--json",
                ]
            )
            == 0
        )
        res = json.loads(capsys.readouterr().out)
        assert res["verify"] == "tree" and res["verified_tokens_per_step"] == 6 and res["num_tokens"] == 8
    assert bench.main(["--target", str(stories_dir), "--verify", "tree", "--tree-budget", "65"]) == 2
    assert "--tree-budget 65" in capsys.readouterr().err


@pytest.mark.gpu
def test_tree_step_graph_is_keyed_by_the_tree_rule(stories_dir, stories):
    """A tree step's CUDA graph holds its tree rule: with ``tree_chain_first`` changed between calls the engine
    captures a second graph instead of replaying the first (the key's last element is Engine.chain_first)."""
    target, _, folder = stories
    params = SamplingParams(max_new_tokens=8)
    want = ReferenceDecoder(target, None, [2]).generate(PROMPTS[:2], params).token_ids
    eng = _engine(stories_dir, folder, device="cuda", impl="triton", cuda_graphs=True, verify="tree", tree_budget=16,
                  tree_chain_first=True)
    assert eng.generate(PROMPTS[:2], params, concurrency=2).token_ids == want
    before = set(eng._graphs)
    assert any(k[2] == ("tree", 16) and k[-1] is True for k in before)
    eng.tree_chain_first = False
    assert eng.generate(PROMPTS[:2], params, concurrency=2).token_ids == want
    new = set(eng._graphs) - before
    assert new and all(k[2] == ("tree", 16) and k[-1] is False for k in new), new


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_engine_tree_cuda_lossless(stories_dir, stories, graphs):
    """CUDA, Triton kernels, fp32: tree output == AR output, eager and under a CUDA graph, trees of 16
    and 64 nodes; T > 0 keeps the τ identity and per-request streams (same output at any concurrency)."""
    target, _, folder = stories
    params = SamplingParams(max_new_tokens=60)
    want = ReferenceDecoder(target, None, [2]).generate(PROMPTS, params).token_ids
    for budget in (16, 64):
        eng = _engine(
            stories_dir,
            folder,
            device="cuda",
            impl="triton",
            cuda_graphs=graphs,
            verify="tree",
            tree_budget=budget,
        )
        for conc in (1, 6):
            assert eng.generate(PROMPTS, params, concurrency=conc).token_ids == want, (budget, conc)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=40, max_new_tokens=40, seed=3)
    res = eng.generate(PROMPTS, p, concurrency=6)
    assert abs(res.stats.tau - 1 - sum(res.stats.accept_at_pos)) < 1e-12
    assert res.token_ids == eng.generate(PROMPTS, p, concurrency=2).token_ids  # per-request streams


def test_engine_planner_is_lossless_and_reports_its_choices(stories_dir, stories):
    """--budget auto: AR steps (with draft features), chains and trees mixed in one decode; the output
    stays the greedy output and every step is counted in the report."""
    target, _, folder = stories
    params = SamplingParams(max_new_tokens=40)
    want = ReferenceDecoder(target, None, [2]).generate(PROMPTS, params).token_ids
    eng = second_choice_engine(  # small trees: a fast CPU test
        _engine(stories_dir, folder, budget="auto", plan_trees=(24,)), [p + w for p, w in zip(PROMPTS, want)]
    )
    assert eng.plan_modes == [("ar", 1), ("chain", 2), ("chain", 4), ("chain", 8), ("tree", 24)]
    assert eng.verified_per_step == 24
    # a table of AR, the full chain and the tree (the narrower chains are not in it, so never chosen or paired); AR cheaper than the speculative steps: the planner's first step is AR (at equal cost AR can never win)
    eng._step_costs = lambda B, params: {("ar", 1): 0.6, ("chain", 8): 1.0, ("tree", 24): 1.0}
    eng.plan_online = False  # this table, not this CPU's step times: the choices below are the table's
    res = eng.generate(PROMPTS, params, concurrency=3)
    assert res.token_ids == want
    rep = eng.planner_report
    assert sum(e["steps"] for e in rep.values()) == res.steps
    assert (
        rep["tree24"]["steps"] > rep["chain8"]["steps"] and rep["tree24"]["tokens_per_step"] > 2
    )  # second choices
    assert rep["ar"]["steps"] >= 1  # before the probes
    assert all(e["measured_ms"] is None for e in rep.values())
    # online (the default): every step timed between the loop's flag reads, prefills excluded; this CPU's
    # steps are far above the fake table's 0.6-1 ms, and AR (timed first) is taken as measured
    eng.plan_online = True
    key = eng._plan_key(3, params)
    assert set(eng.plan_token_memory) == {key} and not eng.plan_cost_memory  # table only: no costs learned
    eng.plan_token_memory.clear()  # a cold start: AR is timed first
    res = eng.generate(PROMPTS, params, concurrency=3)
    assert res.token_ids == want
    rep = eng.planner_report
    timed = [e for e in rep.values() if e["measured_ms"] is not None]
    assert rep["ar"]["measured_ms"] is not None and all(e["measured_ms"] > e["step_ms"] for e in timed)
    wall_ms = (res.elapsed_s - res.prefill_s) * 1e3
    # the AR step's online estimate (log-space median, then a clipped moving average: not the mean) times the AR
    # steps stays within the decode's wall time, prefills excluded; 25% of headroom: on a loaded CPU the product
    # once came to 1.009 x that wall time
    assert rep["ar"]["measured_ms"] * rep["ar"]["steps"] < 1.25 * wall_ms, (rep, wall_ms)
    cold_ar = rep["ar"]["steps"]
    assert cold_ar >= 3  # the cold start's timed AR steps
    # the next call starts from what this one learned (infer.planner, "Across calls"): the memory holds this
    # call's token averages exactly (what it learned depends on this CPU's step times) and AR's timings
    memory, learned = eng.plan_cost_memory[key], eng.plan_token_memory[key]["slow"]
    assert memory["timed"][("ar", 1)] >= 3
    assert {f"{m[0]}{m[1] if m[0] != 'ar' else ''}": x for m, x in learned.items()} == {
        k: e["tokens_per_step"] for k, e in rep.items()}
    from infer.planner import FIRST_TIMED, StepPlanner

    first_choice, choose = [], StepPlanner.choose

    def spy(self, *a, **k):  # what the planner holds at its first choice of the call
        if not first_choice:
            first_choice.append(dict(self.timed))
        return choose(self, *a, **k)

    StepPlanner.choose = spy
    try:
        res = eng.generate(PROMPTS, params, concurrency=3)
    finally:
        StepPlanner.choose = choose
    # no first AR steps to time: AR's timings came with the memory (whether AR then wins depends on this CPU's
    # step times, so its step count is not asserted)
    assert res.token_ids == want and first_choice[0][("ar", 1)] >= FIRST_TIMED, first_choice
    costs = _engine(stories_dir, folder, budget="auto")._step_costs(2, params)  # measured on this CPU
    assert set(costs) == {("ar", 1), ("chain", 2), ("chain", 4), ("chain", 8), ("tree", 16), ("tree", 32)}
    assert min(costs.values()) > 0
    with pytest.raises(ValueError, match="budget='fixed'"):
        _engine(stories_dir, folder, budget="fixed")


def test_engine_plan_trees_sets_the_planner_modes_or_is_refused(stories_dir, stories):
    """plan_trees: the planner's tree sizes, sorted (the cache holds the largest tree); () leaves AR and the chain;
    None is PLAN_TREES. Sizes outside 2..64, repeated, not integers, or given without budget='auto' are refused."""
    _, _, folder = stories
    ar_chains = [("ar", 1), ("chain", 2), ("chain", 4), ("chain", 8)]  # AR, the default narrower chains, the chain
    eng = _engine(stories_dir, folder, budget="auto", plan_trees=(40, 16))
    assert eng.plan_modes == [*ar_chains, ("tree", 16), ("tree", 40)] and eng.verified_per_step == 40
    eng = _engine(stories_dir, folder, budget="auto", plan_trees=())
    assert eng.plan_modes == ar_chains and eng.verified_per_step == 8
    from infer.engine import Engine

    eng = _engine(stories_dir, folder, budget="auto")
    assert eng.plan_trees == Engine.PLAN_TREES == (16, 32) and eng.verified_per_step == 32
    eng = _engine(stories_dir, folder, budget="auto", plan_trees=[4])  # smaller than the chain: the chain's 8 rows
    assert eng.plan_modes == [*ar_chains, ("tree", 4)] and eng.verified_per_step == 8
    for bad in ((1,), (16, 65), (16, 16), (16.0,), (True,), "16", 16, (n for n in (16, 32)), iter([16]), {16}):
        with pytest.raises(ValueError, match="must be a tuple or list of distinct integer tree sizes in 2..64"):
            _engine(stories_dir, folder, budget="auto", plan_trees=bad)
    with pytest.raises(ValueError, match="applies to budget='auto' only"):
        _engine(stories_dir, folder, plan_trees=(16,))


def test_engine_planner_gets_the_batch_for_the_drain_rule(stories_dir, stories, monkeypatch):
    """Once no prompt is queued, the planner loop passes every request of the batch to the drain rule
    (infer.planner, "Drain"): (tokens it may still commit, chain(-equivalent) tokens, steps, tokens²), the
    finished ones with 0 left; before that and with ``plan_drain = False``, nothing. Output stays greedy."""
    from infer import engine as engine_mod

    target, _, folder = stories
    params = SamplingParams(max_new_tokens=40)
    want = ReferenceDecoder(target, None, [2]).generate(PROMPTS, params).token_ids
    seen = []
    choose = engine_mod.StepPlanner.choose

    def spy(self, predicted=None, drain=None, kv=None):
        seen.append(drain)
        return choose(self, predicted, drain)

    monkeypatch.setattr(engine_mod.StepPlanner, "choose", spy)
    made = []
    init = engine_mod.StepPlanner.__init__

    def spy_init(self, costs, **kw):
        made.append(kw.get("drain_model"))
        init(self, costs, **kw)

    monkeypatch.setattr(engine_mod.StepPlanner, "__init__", spy_init)
    for on in ("own", True, False):
        eng = second_choice_engine(_engine(stories_dir, folder, budget="auto", plan_trees=(24,)),
                                   [p + w for p, w in zip(PROMPTS, want)])
        eng._step_costs = lambda B, params: {("ar", 1): 0.6, ("chain", 8): 1.0, ("tree", 24): 1.0}
        eng.plan_online, eng.plan_drain = False, bool(on)
        eng.plan_drain_model = "own" if on == "own" else "scaled"
        made.clear()
        seen.clear()
        assert eng.generate(PROMPTS, params, concurrency=3).token_ids == want
        assert made == [eng.plan_drain_model]
        rep = eng.planner_report
        if not on:
            assert all(d is None for d in seen) and not any(e["drain_steps"] for e in rep.values())
            continue
        first = next(i for i, d in enumerate(seen) if d is not None)  # the queue (6 prompts, 3 slots) ran dry
        given = [i for i, d in enumerate(seen) if d is not None]  # then every PLAN_DRAIN_EVERY choices
        assert first > 3 and given == list(range(first, len(seen), eng.PLAN_DRAIN_EVERY)), (given, len(seen))
        assert len(given) >= 2 and sum(e["drain_steps"] for e in rep.values()) == len(seen) - first
        for d in filter(None, seen[first:]):
            assert 1 <= len(d) <= 3
            for r, t, n, q in d:
                assert 0 <= r <= params.max_new_tokens - 1 and n <= t <= 8 * n and t <= q <= 8 * t, d
        assert seen[first] == [(params.max_new_tokens - 1, 0, 0, 0)] * 3  # the second wave, just admitted: one token each, no step yet
        assert any(r > 0 and n > 0 for d in filter(None, seen) for r, _, n, _ in d)  # live, with chain steps
        assert any(r == 0 for r, *_ in seen[given[-1]]), seen[given[-1]]  # a finished request is kept
    for gone in ("tail", "lead", "persist_len"):  # "lead" (a tree as the request's chain plus its lead) and "persist_len" were removed
        eng.plan_drain_model = gone
        with pytest.raises(ValueError, match=f"Engine.plan_drain_model='{gone}': use 'scaled' or 'own' or 'persist' or 'persist_cap'$"):
            eng.generate(PROMPTS, params, concurrency=3)


def test_engine_tree_step_counts_the_chains_accepted_tokens(stories_dir, stories):
    """--budget auto: after every tree step ``chain_acc`` holds what the chain would have accepted from the
    same draft block (leading draft argmaxes equal to the greedy continuation), and the planner gets it as a
    paired observation of the chain (its tokens_per_step then averages min(chain_acc + 1, verify_size))."""
    target, _, folder = stories
    params = SamplingParams(max_new_tokens=40)
    want = ReferenceDecoder(target, None, [2]).generate(PROMPTS, params).token_ids
    full = [p + w for p, w in zip(PROMPTS, want)]
    eng = second_choice_engine(_engine(stories_dir, folder, budget="auto", plan_trees=(24,)), full)
    eng._step_costs = lambda B, params: {("ar", 1): 2.0, ("chain", 8): 1.9, ("tree", 24): 1.0}  # trees win
    eng.plan_online = False
    drafted, checked = {}, []
    draft_logits, tree_step = eng.draft_logits, eng._tree_step

    def recording_draft(block, cache):
        drafted["logits"], drafted["start"] = draft_logits(block, cache), cache.lengths.clone()
        return drafted["logits"]

    def checking_tree_step(slots, kv, draft_cache, params, N):
        live = [b for b in range(slots.B) if not slots.done[b]]
        tree_step(slots, kv, draft_cache, params, N)
        chain = drafted["logits"].argmax(-1)  # [B, K]
        # the planner's confidence: the chain's E[tau] from q of the argmax (with trees the chain is the block's)
        top = torch.softmax(drafted["logits"].float(), -1).max(-1).values
        assert torch.equal(slots.conf, 1.0 + top.cumprod(-1).sum(-1))
        for b in live:
            seq, start = full[eng.slot_owner[b]], int(drafted["start"][b])
            n = 0
            while n < chain.shape[1] and start + n + 1 < len(seq) and int(chain[b, n]) == seq[start + n + 1]:
                n += 1
            checked.append((int(slots.chain_acc[b]), n))

    eng.draft_logits, eng._tree_step = recording_draft, checking_tree_step
    res = eng.generate(PROMPTS, params, concurrency=3)
    assert res.token_ids == want
    assert len(checked) > 10 and all(got == n for got, n in checked), checked
    assert {n for _, n in checked} >= {0, 1, 2}  # the second-choice draft stops the chain early and late
    rep = eng.planner_report
    assert rep["tree24"]["steps"] > 5 and rep["chain8"]["steps"] <= 2
    assert rep["chain8"]["paired"] >= rep["tree24"]["steps"] - 3  # every observed tree step but the last
    assert 1 < rep["chain8"]["tokens_per_step"] < rep["tree24"]["tokens_per_step"]


def test_engine_tree_step_counts_the_smaller_trees_accepted_tokens(stories_dir, stories):
    """--budget auto with planner trees of 6 and 24 nodes, T = 0: after every step of the tree of 24 ``inner_acc[0]``
    holds what the best-first tree of 6 built from the same draft block accepts against the greedy continuation,
    and the planner gets it as a paired observation of the tree of 6, whose lead it then learns over the chain and
    the tree of 24's over it."""
    from dspine.tree import build_tree, verify_tree

    target, _, folder = stories
    params = SamplingParams(max_new_tokens=40)
    want = ReferenceDecoder(target, None, [2]).generate(PROMPTS, params).token_ids
    full = [p + w for p, w in zip(PROMPTS, want)]
    eng = second_choice_engine(_engine(stories_dir, folder, budget="auto", plan_trees=(6, 24)), full)
    # the tree of 24 wins every step; the tree of 6 never pays its way
    eng._step_costs = lambda B, params: {("ar", 1): 2.0, ("chain", 8): 1.9, ("tree", 6): 9.0, ("tree", 24): 1.0}
    eng.plan_online = False
    drafted, checked = {}, []
    draft_logits, tree_step = eng.draft_logits, eng._tree_step

    def recording_draft(block, cache):
        drafted["logits"], drafted["start"] = draft_logits(block, cache), cache.lengths.clone()
        drafted["anchor"] = block[:, 0].clone()
        return drafted["logits"]

    def checking_tree_step(slots, kv, draft_cache, params, N):
        live = [b for b in range(slots.B) if not slots.done[b]]
        tree_step(slots, kv, draft_cache, params, N)
        small = build_tree(drafted["anchor"], torch.softmax(drafted["logits"].float(), -1), 6, chain_first=False)
        nxt = torch.full(small.tokens.shape, -1, dtype=torch.long)  # the greedy next token after every node
        for b in live:
            seq, start = full[eng.slot_owner[b]], int(drafted["start"][b])
            for i in range(small.size):
                j = start + int(small.depth[b, i]) + 1
                nxt[b, i] = seq[j] if j < len(seq) else -1
        _, a, _ = verify_tree(small, target_argmax=nxt)
        checked.extend((int(slots.inner_acc[0, b]), int(a[b])) for b in live)

    eng.draft_logits, eng._tree_step = recording_draft, checking_tree_step
    res = eng.generate(PROMPTS, params, concurrency=3)
    assert res.token_ids == want
    assert len(checked) > 10 and all(got == n for got, n in checked), checked
    assert {n for _, n in checked} >= {0, 1}
    rep = eng.planner_report
    assert rep["tree24"]["steps"] > 5 and rep["tree6"]["steps"] == 0
    assert rep["tree6"]["paired"] >= rep["tree24"]["steps"] - 3  # every observed tree step but the last
    assert 1 < rep["tree6"]["tokens_per_step"] <= rep["tree24"]["tokens_per_step"]


def test_tree_pairs_reads_the_chain_and_each_smaller_tree_from_its_own_columns(stories_dir, stories):
    """Engine._tree_pairs on a hand-made state snapshot (B = 3, rows 0 and 2 observed, planner trees of 6, 12 and 24,
    a step of the tree of 24): the chain's paired tokens and the drain rule's chain-equivalent tokens come from
    chain_acc, each smaller tree's from its own inner_acc column (the tree of 12's is not read for a step of the tree
    of 12 itself), all capped by the tokens the step committed; a regression test: the drain statistics once read the
    last smaller tree's column."""
    _, _, folder = stories
    eng = _engine(stories_dir, folder, budget="auto", plan_trees=(6, 12, 24))
    B, rows, done = 3, [0, 2], [5, 2]
    chain_acc, inner6, inner12 = [3, 9, 1], [2, 9, 0], [4, 9, 1]
    vals = [0] * (B + 2) + [0] * B + [0] * B + chain_acc + inner6 + inner12  # done, nonfinite, out_len, conf, ...
    table = {("ar", 1): 1.0, ("chain", 8): 1.0, ("tree", 6): 1.0, ("tree", 12): 1.0, ("tree", 24): 1.0}
    paired, chain_done = eng._tree_pairs(vals, B, rows, done, ("tree", 24), table)
    # chain of 8: min(acc + 1, 8, done) = 4 and 2; tree of 6: min(3, 5), min(1, 2); tree of 12: min(5, 5), min(2, 2)
    assert paired == [(("chain", 8), 3.0), (("tree", 6), 2.0), (("tree", 12), 3.5)]
    assert chain_done == [4, 2]
    paired, chain_done = eng._tree_pairs(vals, B, rows, done, ("tree", 12), table)
    assert paired == [(("chain", 8), 3.0), (("tree", 6), 2.0)] and chain_done == [4, 2]
    # a tree the planner left out of its table (the chain-first tree of verify_size at T > 0) is not paired
    paired, _ = eng._tree_pairs(vals, B, rows, done, ("tree", 24), {m: 1.0 for m in table if m != ("tree", 6)})
    assert [m for m, _ in paired] == [("chain", 8), ("tree", 12)]


def test_bench_budget_auto_reports_the_planner(stories_dir, stories, tmp_path, capsys, monkeypatch):
    """infer.bench --budget auto on the CPU engine: greedy output equal to AR's, the summary line names the
    planner's modes, and with DSPINE_PLAN_LOG each planned call's line is tagged with its label, task, turn and
    pass (the start-up warm-up, the task's untimed pass, the timed one)."""
    import json

    log = tmp_path / "plan.jsonl"
    monkeypatch.setenv("DSPINE_PLAN_LOG", str(log))

    from infer import bench
    from tests.conftest import shared_path

    out = tmp_path / "p.json"
    code = bench.main(
        [
            "--target",
            str(stories_dir),
            "--draft",
            f"P={stories[2]}",
            "--datasets",
            "gsm8k",
            "--data-dir",
            str(shared_path("data", "eval")),
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "10",
            "--no-chat-template",
            "--backend",
            "cuda",
            "--device",
            "cpu",
            "--dtype",
            "fp32",
            "--concurrency",
            "2",
            "--budget",
            "auto",
            "--warmup",
            "task",
            "--output-json",
            str(out),
        ]
    )
    assert code == 0
    assert ("--budget auto: the planner picks per step among AR, the chain of 2, the chain of 4, the chain of 8, the "
            "tree of 16, the tree of 32") in capsys.readouterr().out
    tags = [json.loads(line)["tag"] for line in log.read_text().splitlines()]
    runs = {t.pop("run") for t in tags}  # one id for the invocation's calls
    assert len(runs) == 1 and re.fullmatch(r"\d{8}T\d{6}-\d+", runs.pop())
    assert tags == [{"label": "P", "pass": "start"}, {"label": "P", "task": "gsm8k", "turn": 0, "pass": "warmup"},
                    {"label": "P", "task": "gsm8k", "turn": 0, "pass": "timed"}]
    d = json.loads(out.read_text())["tasks"][0]["drafts"]["P"]
    assert d["greedy_equal"] == d["greedy_compared"] == 2 and d["verified_tokens_per_step"] == "auto"
    assert set(d["planner_choices"]) == {"ar", "chain2", "chain4", "chain8", "tree16", "tree32"}
    assert sum(c["steps"] for c in d["planner_choices"].values()) >= d["verify_steps"] / 2  # 2 rows per step
    assert all(c["step_ms"] > 0 for c in d["planner_choices"].values())
    assert bench.main(["--target", str(stories_dir), "--budget", "auto", "--backend", "reference"]) == 2
    assert "--budget auto needs the engine" in capsys.readouterr().err
    # --plan-drain: the engine's --budget auto only
    base = ["--target", str(stories_dir), "--draft", f"P={stories[2]}", "--no-plan-drain"]
    assert bench.main([*base, "--backend", "reference"]) == 2
    assert "--plan-drain / --no-plan-drain need the engine" in capsys.readouterr().err
    assert bench.main([*base, "--backend", "cuda", "--device", "cpu", "--dtype", "fp32"]) == 2
    assert "apply to --budget auto only" in capsys.readouterr().err
    assert d["planner_choices"]["ar"]["drain_steps"] <= d["planner_choices"]["ar"]["steps"]


def test_generate_plan_drain_needs_budget_auto(stories_dir, stories, capsys):
    from infer import generate

    argv = ["--target", str(stories_dir), "--draft", str(stories[2]), "--prompt", "hi", "--no-plan-drain"]
    assert generate.main(argv) == 2
    assert "--plan-drain / --no-plan-drain apply to --budget auto only" in capsys.readouterr().err
    base = ["--target", str(stories_dir), "--draft", str(stories[2]), "--prompt", "hi"]
    for extra, msg in ((["--plan-trees", "16/32"], "--plan-trees 16/32: applies to --budget auto only"),
                       (["--budget", "auto", "--plan-trees", "16/"], "--plan-trees: plan_trees='16/'; expected tree sizes"),
                       (["--budget", "auto", "--plan-trees", "8/8"], "each size must be in 2..64, none repeated")):
        assert generate.main(base + extra) == 2
        assert msg in capsys.readouterr().err, extra


def test_generate_json_reports_the_planner_settings(stories_dir, stories, capsys, monkeypatch):
    """--json names the planner's resolved tree sizes and drain rule under --budget auto, null without it. The engine
    runs on the CPU here: infer.generate takes --backend cuda only where CUDA is, so both are patched."""
    import json

    from infer import engine as engine_mod
    from infer import generate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(generate, "load_engine", lambda *a, **kw: engine_mod.load_engine(*a, **{**kw, "device": "cpu"}))
    base = ["--target", str(stories_dir), "--draft", str(stories[2]), "--prompt", "Once", "--no-chat-template",
            "--max-new-tokens", "6", "--backend", "cuda", "--dtype", "fp32", "--json"]
    for extra, trees, drain in (([], None, None), (["--budget", "auto"], [16, 32], "persist"),
                                (["--budget", "auto", "--plan-trees", "24/12", "--no-plan-drain"], [12, 24], "off")):
        assert generate.main(base + extra) == 0, extra
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert (out["plan_trees"], out["plan_drain"]) == (trees, drain), extra
        assert out["plan_conf_slope"] == (None if trees is None else "auto"), extra


def test_parse_plan_trees():
    import re

    from infer.planner import parse_plan_trees

    assert parse_plan_trees("32/16") == (32, 16) and parse_plan_trees("none") == () and parse_plan_trees("64") == (64,)
    # plain decimal digits only: int() would also take a sign, '_', spaces and non-ASCII digits
    for bad in ("", "16,32", "1/16", "16/65", "x", "16/16", "-4", "+16", "1_6", " 16", "16/ 32", "١٦"):
        with pytest.raises(ValueError, match=re.escape(f"plan_trees={bad!r}")):
            parse_plan_trees(bad)


def test_planner_trees_need_the_full_block_width(stories_dir, stories):
    """budget='auto' with trees and a chain narrower than the draft block is refused (a tree step commits up to
    the block's depth); with plan_trees=() the narrower chain is fine."""
    _, _, folder = stories
    with pytest.raises(ValueError, match="needs verify_size equal to the draft's block size"):
        _engine(stories_dir, folder, budget="auto", verify_size=4)
    # the default narrower chains below that width stay (the chain of 2)
    assert _engine(stories_dir, folder, budget="auto", verify_size=4, plan_trees=()).plan_modes == [
        ("ar", 1), ("chain", 2), ("chain", 4)]


def test_engine_done_rows_read_no_cache_and_kv_counts_the_live_requests(stories_dir, stories, monkeypatch):
    """A finished row's target step takes cache length 0 (Engine._attn_lengths: the step computes every row, and at
    its own length its attention would read its whole cache): in the steps with one request left, one row has a
    length and the others 0; the output stays greedy. Planner state "kv" is told the live requests' context tokens
    (prompt + committed), which fall as requests finish and are one request's at the end."""
    from infer import engine as engine_mod

    target, _, folder = stories
    params = SamplingParams(max_new_tokens=40)
    want = ReferenceDecoder(target, None, [2]).generate(PROMPTS, params).token_ids
    seen, lens = [], []
    observe = engine_mod.StepPlanner.observe

    def spy(self, mode, tokens, ms=None, rows=1, kv=None):
        seen.append((rows, kv))
        return observe(self, mode, tokens, ms, rows, kv)

    monkeypatch.setattr(engine_mod.StepPlanner, "observe", spy)
    eng = second_choice_engine(_engine(stories_dir, folder, budget="auto"), [p + w for p, w in zip(PROMPTS, want)])
    step = eng.target.forward_step

    def spy_step(tokens, positions, cache, cache_len, **kw):
        lens.append(cache_len.tolist())
        assert (positions[:, 0] == cache_len).all()  # a done row's positions start at 0 too
        return step(tokens, positions, cache, cache_len, **kw)

    eng.target.forward_step = spy_step
    eng._step_costs = lambda B, params: {("ar", 1): 3.0, ("chain", 8): 1.0, ("tree", 32): 9.0, ("tree", 64): 9.0}
    eng.plan_state = "kv"
    assert eng.generate(PROMPTS, params, concurrency=len(PROMPTS)).token_ids == want
    assert lens and sum(x > 0 for x in lens[-2]) == 1 and max(lens[-2]) >= 30  # one request left, the rest at 0
    assert any(0 < sum(x > 0 for x in row) < len(PROMPTS) - 1 for row in lens)  # finished rows at 0 beside live ones
    assert min(r for r, _ in seen) == 1 and seen[-1][1] <= max(len(p) for p in PROMPTS) + 40
    assert max(kv for _, kv in seen) > seen[-1][1] + 100  # the batch's tokens, then one request's

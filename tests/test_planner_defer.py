"""The planner's deferred draft-context append (``Engine(budget="auto")``): AR steps leave their target
features pending (``pend_feats``, ``pend_count``), a flush appends them (``Engine._flush_step``), the loop
flushes before a speculative step and after F AR steps, and an admission drops a refilled slot's pending
features (``Engine._admit``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dspine.model import DraftCache
from dspine.reference import ReferenceDecoder
from dspine.sampling import SamplingParams
from infer import engine as engine_mod
from tests.test_engine import PROMPTS, _engine
from tests.test_engine_tree import stories  # noqa: F401 (module fixture: target + random block-8 draft)

AR, CHAIN, TREE = ("ar", 1), ("chain", 8), ("tree", 24)
SAMPLED = dict(temperature=1.0, top_p=0.9, top_k=40, seed=5)
# a forced mode sequence (repeated): AR stretches longer than F = 16 (a flush after the 16th AR step), shorter
# ones, a tree and chains after AR (a flush before each), and a chain after a chain (nothing pending)
PATTERN = [AR] * 20 + [CHAIN] + [AR] * 3 + [TREE] + [AR] * 17 + [CHAIN, CHAIN]


def _admitted(stories_dir, folder, params, defer, B=4, **kw):
    """An auto-budget engine with PROMPTS[:B] prefilled into slots 0..B-1; its planner AR step (deferring or
    appending at once) and its flush, both built before the admission (a CUDA graph capture resets the slots)."""
    eng = _engine(stories_dir, folder, budget="auto", **kw)
    eng.defer_ar_append = defer
    s = eng._slots_for(B)
    kv, dcache = eng._cache_view(B)
    step = eng._runner(B, params, True, AR)
    flush = eng._runner(B, params, True, ("flush", eng.ar_defer))
    eng._admit(s, list(enumerate(PROMPTS[:B])), params, True, kv, dcache, [11 + b for b in range(B)])
    return SimpleNamespace(eng=eng, s=s, dcache=dcache, step=step, flush=flush)


def _assert_same_context(a, b, tol=1e-5):
    """Equal lengths, and draft K/V equal within ``tol`` at every row's positions < lengths."""
    assert torch.equal(a.s.lengths, b.s.lengths) and torch.equal(a.dcache.lengths, b.dcache.lengths)
    for i in range(len(a.dcache.k)):
        for row, n in enumerate(a.s.lengths.tolist()):
            for ca, cb in ((a.dcache.k[i], b.dcache.k[i]), (a.dcache.v[i], b.dcache.v[i])):
                torch.testing.assert_close(ca[row, :, :n], cb[row, :, :n], rtol=tol, atol=tol)


def _check_deferral(stories_dir, folder, temperature, **kw):
    params = SamplingParams(max_new_tokens=60, **(SAMPLED if temperature else {}))
    deferred = _admitted(stories_dir, folder, params, True, **kw)
    immediate = _admitted(stories_dir, folder, params, False, **kw)
    s, F = deferred.s, deferred.eng.ar_defer
    assert immediate.s.pend_count is not None and F == 16
    for k in (1, 5, F):
        start = s.lengths.clone()
        for run in (deferred, immediate):
            run.s.done.copy_(torch.tensor([0, 1, 0, 0], dtype=torch.int8))  # row 1 idle throughout
            for t in range(k):
                if t == 2:
                    run.s.done[3] = 1  # row 3 idle after 2 steps
                run.step()
        # pending = the steps each row was live in; lengths advanced as by the immediate append
        assert torch.equal(s.pend_count, s.lengths - start) and torch.equal(s.lengths, immediate.s.lengths)
        assert s.pend_count.tolist()[1:] == [0, k, min(k, 2)] and int(s.pend_count[0]) == k, s.pend_count
        assert not immediate.s.pend_count.any()
        deferred.flush()
        assert not s.pend_count.any() and torch.equal(s.pend_lengths, s.lengths)
        assert torch.equal(s.out_tokens, immediate.s.out_tokens)
        assert torch.equal(s.out_len, immediate.s.out_len)
        # not bit for bit: the flush's fc and K/V GEMMs run over B·F rows, the immediate append's over B, and the
        # BLAS blocks them differently (fp32 rounding, ~1e-6 here)
        _assert_same_context(deferred, immediate)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_deferred_append_then_flush_equals_the_immediate_append(stories_dir, stories, temperature):  # noqa: F811
    """k = 1, 5 and F planner AR steps that defer, then a flush, against the same steps appending at once (two
    engines from the same state; greedy and sampled): equal lengths and output, draft K/V equal within fp32
    rounding at every position < lengths of every row; row 1 idle throughout, row 3 idle after 2 steps."""
    _check_deferral(stories_dir, stories[2], temperature)


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_deferred_append_in_the_cuda_graph(stories_dir, stories, temperature):  # noqa: F811
    """The same with the AR steps and the flush replayed as CUDA graphs (static buffers, no host sync)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _check_deferral(stories_dir, stories[2], temperature, device="cuda", impl="triton", cuda_graphs=True)


def _check_context(eng, s, dcache, prompts, tol=1e-4):
    """Every live row's draft context, read by the speculative step about to run: nothing pending, and the
    K/V of positions < lengths equal to those of its committed tokens (prompt + output but the anchor)
    prefilled through the target into a fresh draft cache (fp32: incremental and prefill features differ
    by rounding only; a stale or missing position differs by O(1)). A sliding-window layer is compared on the
    positions the draft reads, the last ``sliding_window`` ones, at their ring slots (position p at p % cap)."""
    owner = eng.slot_owner
    for b in range(s.B):
        if s.done[b] or owner[b] is None:
            continue
        assert s.pend_count is None or s.pend_count[b] == 0, ("pending features at a speculative step", b)
        n = int(dcache.lengths[b])
        seq = prompts[owner[b]] + s.out_tokens[b, : int(s.out_len[b])].tolist()
        assert n == len(seq) - 1, (b, n, len(seq))
        _, feats = eng.target.prefill_packed([torch.tensor(seq[:n])], [0], eng.target.new_cache(1, n + 1))
        ref = DraftCache(eng.draft, 1, eng.draft_cache.capacity)
        ref.append(feats[None], torch.tensor([n]))
        for i in range(len(ref.k)):
            idx = torch.arange(n)
            if eng.draft.layers[i].sliding:
                window = eng.draft.config.sliding_window
                idx = torch.arange(max(0, n - window), n) % dcache.caps[i]
            for got, want in ((dcache.k[i], ref.k[i]), (dcache.v[i], ref.v[i])):
                err = (got[b][:, idx] - want[0][:, idx]).abs().max()
                assert err <= tol * (1 + want[0][:, idx].abs().max()), (b, i, float(err))


def _forced_planner_engine(stories_dir, folder, prompts, monkeypatch, defer=True, pattern=PATTERN, **kw):
    """An auto-budget engine whose planner runs ``pattern`` (its bookkeeping runs, its choice is replaced), with a
    log of the device calls: ("ar", most pending after it), ("flush", most pending before it), ("spec", mode)
    (after checking every live row's draft context) and ("admit", pending of the admitted slots)."""
    eng = _engine(stories_dir, folder, budget="auto", plan_trees=(TREE[1],), **kw)
    eng.defer_ar_append = defer
    eng._step_costs = lambda B, params: {AR: 0.6, CHAIN: 1.0, TREE: 1.0}
    choose = engine_mod.StepPlanner.choose

    def scripted(self, predicted=None, drain=None, kv=None):
        choose(self, predicted, drain)
        return pattern[(self.step - 1) % len(pattern)]

    monkeypatch.setattr(engine_mod.StepPlanner, "choose", scripted)
    log = []
    ar_step, flush_step, spec_step, admit = eng._ar_step, eng._flush_step, eng._spec_step, eng._admit

    def ar(s, *a):
        ar_step(s, *a)
        log.append(("ar", int(s.pend_count.max())))

    def flush(s, dcache):
        log.append(("flush", int(s.pend_count.max())))
        flush_step(s, dcache)

    def spec(s, kv, dcache, params, mode=None):
        _check_context(eng, s, dcache, prompts)
        log.append(("spec", mode))
        spec_step(s, kv, dcache, params, mode)

    def admitted(s, items, *a):
        log.append(("admit", s.pend_count[[b for b, _ in items]].tolist()))
        eng.admit_defer.append(a[-1])  # the prompts' draft context deferred (Engine.plan_defer_prompt)
        admit(s, items, *a)

    eng._ar_step, eng._flush_step, eng._spec_step, eng._admit = ar, flush, spec, admitted
    eng.admit_defer = []
    return eng, log


def _assert_flushes(log, F=16):
    """Pending never above F; a flush before every speculative step after AR steps, after the F-th AR step,
    and an admission into slots with features pending (dropped by _admit) followed by speculative steps."""
    assert max(p for kind, p in log if kind == "ar") == F
    for prev, cur in zip(log, log[1:]):
        if cur[0] == "spec":
            assert prev[0] != "ar", "AR steps then a speculative step without a flush"
    flushes = [(prev, nxt) for prev, (kind, _), nxt in zip(log, log[1:], log[2:]) if kind == "flush"]
    assert any(nxt[0] == "spec" for _, nxt in flushes)  # (a)
    assert any(prev == ("ar", F) and nxt[0] == "ar" for prev, nxt in flushes)  # (b)
    refills = [i for i, (kind, pend) in enumerate(log) if kind == "admit" and any(pend)]
    assert refills and any(kind == "spec" for kind, _ in log[refills[0] :])  # (c)


@pytest.mark.parametrize("buckets", [False, True])
def test_planner_with_deferred_appends_is_lossless(stories_dir, stories, monkeypatch, buckets):  # noqa: F811
    """--budget auto, greedy, 6 prompts at concurrency 3 (refills), the forced PATTERN: the output is the plain
    engine's (chain, AR) and the target's; at every speculative step every live row's draft context is the
    context of its committed tokens; the flushes before speculative steps, after F AR steps, and the admission
    dropping a refilled slot's pending features are all exercised (removing either the flush before a
    speculative step or _admit's pend_count reset makes the context check fail). With bucketed prefill the
    admissions write the draft context inside the bucketed pass: the same checks hold."""
    target, _, folder = stories
    params = SamplingParams(max_new_tokens=40)
    want = ReferenceDecoder(target, None, [2]).generate(PROMPTS, params).token_ids
    plain = _engine(stories_dir, folder)
    assert plain.generate(PROMPTS, params, concurrency=3).token_ids == want
    assert plain.generate(PROMPTS, params, concurrency=3, use_draft=False).token_ids == want
    eng, log = _forced_planner_engine(stories_dir, folder, PROMPTS, monkeypatch, prefill_buckets=buckets)
    assert eng.prefill_buckets == buckets
    res = eng.generate(PROMPTS, params, concurrency=3)
    assert res.token_ids == want
    _assert_flushes(log)
    assert {m for kind, m in log if kind == "spec"} == {CHAIN, TREE}


def test_planner_deferral_keeps_sampled_output(stories_dir, stories, monkeypatch):  # noqa: F811
    """T = 1, same seeds, the forced PATTERN: deferring and immediate appends give the same tokens (the same
    steps draw from the same streams; the draft's K/V differ by fp32 rounding only, no sample parts here),
    every speculative step reads the right draft context in both, and the immediate engine never flushes."""
    params = SamplingParams(max_new_tokens=40, **SAMPLED)
    out = {}
    for defer in (True, False):
        eng, log = _forced_planner_engine(stories_dir, stories[2], PROMPTS, monkeypatch, defer)
        out[defer] = eng.generate(PROMPTS, params, concurrency=3).token_ids
        if defer:
            _assert_flushes(log)
        else:
            assert not any(kind == "flush" for kind, _ in log)
            assert all(p == 0 for kind, p in log if kind == "ar")
    assert out[True] == out[False]
    assert len({tuple(t) for t in out[True]}) == len(PROMPTS)


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_ar_defer_must_be_a_positive_int(stories_dir, stories, bad):  # noqa: F811
    eng = _engine(stories_dir, stories[2], budget="auto")
    eng.ar_defer = bad
    with pytest.raises(ValueError, match=rf"Engine.ar_defer={bad!r}: must be an int >= 1"):
        eng.generate(PROMPTS[:2], SamplingParams(max_new_tokens=4))


def test_plan_schedule_runs_its_modes_in_turn(stories_dir, stories):  # noqa: F811
    """Engine.plan_schedule (bench_planner_loop.py --switch): the planner's loop runs the chain and a tree in turn,
    step after step, losslessly (greedy output = the target's); a mode outside plan_modes is refused by name."""
    target, _, folder = stories
    params = SamplingParams(max_new_tokens=30)
    want = ReferenceDecoder(target, None, [2]).generate(PROMPTS[:2], params).token_ids
    eng = _engine(stories_dir, folder, budget="auto", plan_trees=(TREE[1],))
    eng.plan_schedule = [CHAIN, TREE]
    assert eng.generate(PROMPTS[:2], params, concurrency=2).token_ids == want
    steps = {k: v["steps"] for k, v in eng.planner_report.items()}
    assert steps["ar"] == 0 and abs(steps["chain8"] - steps["tree24"]) <= 1 and steps["tree24"] >= 3
    eng.plan_schedule = [CHAIN, ("tree", 16)]
    with pytest.raises(ValueError, match=r"plan_schedule has modes \[\('tree', 16\)\] outside this run's planner modes"):
        eng.generate(PROMPTS[:2], params)


def test_plan_log_records_every_choice_and_observation(stories_dir, stories, tmp_path, monkeypatch):  # noqa: F811
    """DSPINE_PLAN_LOG: one JSON line per planned call, its choices one per engine step with the mode the planner
    ran (the counts per mode equal planner_report's), its observations those the report counts, the output
    unchanged by logging; a second call appends a second line."""
    import json

    target, _, folder = stories
    params = SamplingParams(max_new_tokens=30)
    want = ReferenceDecoder(target, None, [2]).generate(PROMPTS[:3], params).token_ids
    path = tmp_path / "plan.jsonl"
    monkeypatch.setenv("DSPINE_PLAN_LOG", str(path))
    eng = _engine(stories_dir, folder, budget="auto", plan_trees=(TREE[1],))
    for call in (1, 2):
        res = eng.generate(PROMPTS[:3], params, concurrency=2)
        assert res.token_ids == want
        lines = path.read_text().splitlines()
        assert len(lines) == call
        rec = json.loads(lines[-1])
        assert (rec["device"], rec["batch"], rec["prompts"], rec["steps"]) == ("cpu", 2, 3, res.steps)
        assert rec["tokens"] == sum(map(len, res.token_ids)) and rec["lengths"] == [len(t) for t in res.token_ids]
        names, events = rec["log"][0], rec["log"][1:]
        assert names == ["ar:1", "chain:2", "chain:4", "chain:8", "tree:24"]  # the default narrower chains too
        chosen = [e for e in events if e[0] == "c"]
        assert len(chosen) == res.steps and [e[1] for e in chosen] == list(range(chosen[0][1], chosen[0][1] + res.steps))
        report = eng.planner_report
        for i, name in enumerate(("ar", "chain2", "chain4", "chain8", "tree24")):
            assert sum(e[2] == i for e in chosen) == report[name]["steps"]
            assert sum(e[0] == "o" and e[1] == i for e in events) == report[name]["observed"]
        # 3 prompts at concurrency 2: the queue empties after one refill; per slot still decoding (or finished with
        # chain steps counted) [remaining, chain tokens, chain steps, chain tokens²], remaining falling from one
        # refresh to the next (tokens² at least tokens, each step committing at least 1)
        drains = [e for e in events if e[0] == "d"]
        assert drains and all(len(e[2]) == 2 and all(len(r) == 4 and 0 <= r[0] <= 30 and r[3] >= r[1] >= r[2] >= 0
                                                          for r in e[2]) for e in drains)
        assert max(r[0] for r in drains[0][2]) > max(r[0] for r in drains[-1][2]) or len(drains) == 1
        judged = [e[5] for e in chosen if e[5] is not None]
        assert judged and all(len(r) == len(names) and r[0] is not None and r[0] > 0 for r in judged)  # AR always has a rate


def _count_writes(eng) -> list:
    """Wrap eng._write_deferred: the returned list gets, per call, the written? flag of every deferred prompt."""
    writes, write = [], eng._write_deferred

    def counted(s, dcache):
        writes.append([k for e in s.ctx_pending for k in e.keep])
        write(s, dcache)

    eng._write_deferred = counted
    return writes


@pytest.mark.parametrize("buckets", [False, True])
def test_deferred_prompt_context_is_written_before_the_draft_reads_it(stories_dir, stories, monkeypatch,  # noqa: F811
                                                                      buckets):
    """Engine.plan_defer_prompt: while AR is the planner's best mode (no speculative estimate yet, or AR's rate the
    best) its admissions keep the prompts' features and count their positions, and the first speculative step
    writes them (_write_deferred) under the AR steps' positions: greedy, 6 prompts at concurrency 3 (refills, some
    into slots whose previous prompt was never written), the forced PATTERN, with and without bucketed prefill.
    At every speculative step every live row's draft context is its committed tokens' (_check_context); the output
    equals the target's and the engine's without deferral."""
    target, _, folder = stories
    params = SamplingParams(max_new_tokens=40)
    want = ReferenceDecoder(target, None, [2]).generate(PROMPTS, params).token_ids
    out = {}
    for defer in (True, False):
        eng, log = _forced_planner_engine(stories_dir, folder, PROMPTS, monkeypatch, prefill_buckets=buckets)
        eng.plan_defer_prompt = defer
        # the table's costs stay (no online step times): whether drafting pays at a refill then follows the acceptance
        # alone, not a loaded CPU's step times (the refills' deferral flipped with them: 1 run in 4 under load)
        eng.plan_online = False
        writes = _count_writes(eng)
        out[defer] = eng.generate(PROMPTS, params, concurrency=3).token_ids
        assert out[defer] == want
        _assert_flushes(log)
        if defer:  # the first admission (nothing learned yet) and the refills in AR stretches deferred
            assert eng.admit_defer[0] and sum(eng.admit_defer) >= 2 and writes, eng.admit_defer
        else:
            assert not any(eng.admit_defer) and not writes


def test_deferred_prompt_of_a_finished_request_is_never_written(stories_dir, stories, monkeypatch):  # noqa: F811
    """Requests that finish inside an AR stretch (30 AR steps, then chains; 24 new tokens): their slots are
    refilled before any speculative step, so the first one writes the live rows' deferred prompts and sends the
    finished requests' to the scratch slot; every live row's context is right at every speculative step, the
    sampled output is the plain engine's AR output (drafter-invariant verification)."""
    params = SamplingParams(max_new_tokens=24, invariant=True, **SAMPLED)
    folder = stories[2]
    want = _engine(stories_dir, folder).generate(PROMPTS[:5], params, use_draft=False).token_ids
    eng, log = _forced_planner_engine(stories_dir, folder, PROMPTS, monkeypatch, pattern=[AR] * 30 + [CHAIN] * 10)
    writes = _count_writes(eng)
    assert eng.generate(PROMPTS[:5], params, concurrency=3).token_ids == want
    assert eng.admit_defer == [True, True] and any(kind == "spec" for kind, _ in log)
    assert len(writes) == 1 and sorted(writes[0]) == [False, False, True, True, True], writes


def test_deferred_prompt_context_never_written_by_an_ar_only_call(stories_dir, stories, monkeypatch):  # noqa: F811
    """A planned call that runs AR at every step (the planner at concurrency 64, T = 1 on the H200) writes no
    prompt context: no packed draft-context append at admission or later; the prompts' features wait in
    ctx_pending, which the next call drops. (The AR steps' own features are still flushed every F steps: a later
    speculative step would read those positions.) Sampled output = the plain engine's AR output."""
    params = SamplingParams(max_new_tokens=24, **SAMPLED)
    folder = stories[2]
    want = _engine(stories_dir, folder).generate(PROMPTS[:3], params, use_draft=False).token_ids
    eng = _engine(stories_dir, folder, budget="auto", plan_trees=(TREE[1],))
    eng.plan_schedule = [AR]
    calls = []
    packed = DraftCache.append_packed
    monkeypatch.setattr(DraftCache, "append_packed", lambda self, *a, **k: (calls.append(k), packed(self, *a, **k)))
    assert eng.generate(PROMPTS[:3], params, concurrency=3).token_ids == want
    assert calls == [] and eng.planner_report["ar"]["steps"] > 0
    s = eng._slots_for(3)
    assert [e.slots for e in s.ctx_pending] == [[0, 1, 2]]
    eng.plan_schedule = [CHAIN]  # the next call: its own prompts' context, written before its first chain step
    eng.generate(PROMPTS[3:6], params, concurrency=3)
    assert [k.get("prefix") for k in calls] == [True] and s.ctx_pending == []


# prompts of 1 to 40 tokens
LONG = [[1] + [300 + (7 * i + j) % 150 for j in range(n)] for i, n in enumerate([0, 39, 3, 25, 1, 31, 12, 20])]


@pytest.fixture(scope="module")
def sliding(stories_dir, tmp_path_factory):
    """(target, folder): stories260K and an untrained block-8 draft whose first layer has a sliding window of 6
    (a ring of 14 positions), saved to a folder."""
    from dspine.checkpoint import save_draft
    from dspine.target import load_target
    from tests.helpers import random_draft

    target = load_target(str(stories_dir), dtype="fp32")
    draft = random_draft(target, mask=0, layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    return target, save_draft(draft, tmp_path_factory.mktemp("sliding-draft"))


@pytest.mark.parametrize("buckets", [False, True])
def test_deferred_prompt_under_a_wrapped_ring(stories_dir, sliding, monkeypatch, buckets):
    """A sliding-window draft (ring of 14), prompts of 1 to 40 tokens, 30 AR steps (the ring wraps over the AR
    positions) and then chains: the deferred prompts are written under positions that evicted part of them, and
    at every speculative step the window the draft reads equals a fresh prefill's (_check_context); greedy output
    equals the target's."""
    target, folder = sliding
    params = SamplingParams(max_new_tokens=50)
    prompts = LONG[:6]
    want = ReferenceDecoder(target, None, [2]).generate(prompts, params).token_ids
    eng, log = _forced_planner_engine(stories_dir, folder, prompts, monkeypatch, pattern=[AR] * 30 + [CHAIN] * 6,
                                      prefill_buckets=buckets)
    assert eng.draft.layers[0].sliding and eng.draft_cache.caps[0] == 14
    writes = _count_writes(eng)
    assert eng.generate(prompts, params, concurrency=3).token_ids == want
    assert eng.admit_defer[0] and writes and any(kind == "spec" for kind, _ in log)


def test_the_step_after_a_deferred_prompt_write_is_timed_without_it(stories_dir, stories, monkeypatch):  # noqa: F811
    """The first speculative step after deferred prompts is timed from the end of their write (an admission's work,
    which charged to the step once set a mode's measured ÷ table ratio for good): the write moves the host clock the
    engine reads (time.perf_counter) on by 1000 s, and that chain step is still observed with a step's time (the CPU
    times a step from its launch to the next), not 10⁶ ms."""
    import time

    params = SamplingParams(max_new_tokens=24)
    eng, _ = _forced_planner_engine(stories_dir, stories[2], PROMPTS, monkeypatch, pattern=[AR] * 30 + [CHAIN] * 10)
    seen, write, observe, real, skew = [], eng._write_deferred, engine_mod.StepPlanner.observe, time.perf_counter, [0.0]

    def slow(s, dcache):
        write(s, dcache)
        skew[0] += 1000.0
        seen.append(("write", None))

    def spy(self, mode, x, ms=None, rows=1, kv=None):
        seen.append((mode, ms))
        return observe(self, mode, x, ms, rows)

    eng._write_deferred = slow
    monkeypatch.setattr(engine_mod.StepPlanner, "observe", spy)
    monkeypatch.setattr(engine_mod.time, "perf_counter", lambda: real() + skew[0])
    eng.generate(PROMPTS[:5], params, concurrency=3)
    first = seen.index(("write", None))
    after = [ms for mode, ms in seen[first:] if mode == CHAIN]
    assert after and after[0] is not None and 0 < after[0] < 100_000, seen[first:first + 4]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_drain_refresh_is_no_steps_time(stories_dir, stories, monkeypatch, device):  # noqa: F811
    """A drain refresh (host work in StepPlanner.choose) is charged to no step. On the CPU the refresh moves the
    host clock the engine reads (time.perf_counter) on by 1000 s, and every step is still observed with a step's time
    (timed to the next launch, the step before a refresh read 10⁶ ms); on CUDA the refresh sleeps 300 ms, which leaves
    the device idle before the launch, and every step reads under 150 ms (timed from the snapshot before, the step
    chosen with the refresh read the sleep)."""
    import time

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    kw = {"device": "cuda", "impl": "triton", "cuda_graphs": True} if device == "cuda" else {}
    eng = _engine(stories_dir, stories[2], budget="auto", **kw)
    choose, observe, real, skew, seen = engine_mod.StepPlanner.choose, engine_mod.StepPlanner.observe, time.perf_counter, [0.0], []

    def slow(self, predicted=None, drain=None, kv=None):
        if drain is not None:
            if device == "cuda":
                time.sleep(0.3)
            skew[0] += 1000.0 if device == "cpu" else 0.0
            seen.append("refresh")
        return choose(self, predicted, drain)

    def spy(self, mode, x, ms=None, rows=1, kv=None):
        seen.append(ms)
        return observe(self, mode, x, ms, rows)

    monkeypatch.setattr(engine_mod.StepPlanner, "choose", slow)
    monkeypatch.setattr(engine_mod.StepPlanner, "observe", spy)
    monkeypatch.setattr(engine_mod.time, "perf_counter", lambda: real() + skew[0])
    eng.generate(PROMPTS[:3], SamplingParams(max_new_tokens=40), concurrency=3)  # no queue: drains from the start
    timed = [ms for ms in seen if isinstance(ms, float)]
    assert seen.count("refresh") >= 2 and len(timed) >= 8, seen
    assert min(timed) > 0 and max(timed) < (100_000.0 if device == "cpu" else 150.0), seen

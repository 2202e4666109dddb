"""dspine.ops.tree_build: the fused tree builder (Triton: interpreter on the CPU, compiled on CUDA) returns
exactly the torch reference's tree (dspine.tree.build_tree), ancestor mask and ancestor bits."""

import tests.kernel_env as env  # noqa: I001  (must precede the kernel imports)

import json

import pytest
import torch

from dspine.ops.tree_build import build_tree_fused
from dspine.tree import ancestor_bits, ancestor_mask, build_tree

CPU = pytest.mark.skipif(not env.TRITON_CPU, reason=str(env.TRITON_CPU_SKIP))
FIELDS = ("tokens", "parent", "depth", "chain", "anc", "bits", "rank")


def draft(kind: str, B: int, K: int, V: int, seed: int, device="cpu"):
    """(q [B, K, V] fp32, chain_tokens [B, K] or None) of one kind:
    random: softmax(3·randn); ties: integer weights 0..3 (exact ties in q, in log q and in path sums,
    a quarter zeros); sparse: 3 nonzero tokens per depth (most of a large tree is padding);
    sampled: random q with chain tokens drawn from q (not the argmax: T > 0), row 0's at depth 0 a
    token of q = 0."""
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":
        w = torch.randint(0, 4, (B, K, V), generator=g).float()
        w[..., 0] += 1  # no all-zero row
        q = w / w.sum(-1, keepdim=True)
    else:
        q = torch.softmax(3 * torch.randn(B, K, V, generator=g), -1)
    if kind == "sparse":
        keep = torch.rand(B, K, V, generator=g).argsort(-1)[..., :3]
        q = torch.zeros_like(q).scatter(-1, keep, q.gather(-1, keep))
        q = q / q.sum(-1, keepdim=True)
    chain = None
    if kind == "sampled":
        chain = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, K)
        q[0, 0, (chain[0, 0] + 1) % V] = 0.0
        chain[0, 0] = (chain[0, 0] + 1) % V
    return q.to(device), None if chain is None else chain.to(device)


def assert_same(got, want):
    for f in FIELDS:
        a, b = getattr(got, f), getattr(want, f)
        assert a.dtype == b.dtype and a.shape == b.shape, f
        rows = (a != b).flatten(1).any(1).nonzero().flatten().tolist()
        assert torch.equal(a, b), f"{f} differs in rows {rows}"


def check(kind, B, K, V, N, seed, device, chain_first=True):
    q, chain = draft(kind, B, K, V, seed, device)
    anchor = torch.arange(100, 100 + B, device=device)
    want = build_tree(anchor, q, N, chain, chain_first=chain_first)
    assert torch.equal(want.anc, ancestor_mask(want.parent))
    want.bits = ancestor_bits(want.anc)
    got = build_tree_fused(anchor, q, N, chain, impl="triton", chain_first=chain_first)
    assert_same(got, want)
    # chain_q: q at the chain tokens (given, else the argmax), bit for bit, from both builders (the planner's
    # confidence reads it: infer.engine.Engine._tree_step)
    chain_tok = q.argmax(-1) if chain is None else chain
    q_chain = q.gather(-1, chain_tok[..., None])[..., 0]
    ref = build_tree_fused(anchor, q, N, chain, impl="torch", chain_first=chain_first)
    for tree in (got, ref):
        assert tree.chain_q.dtype == torch.float32 and torch.equal(tree.chain_q, q_chain)
    return got, want


CASES = [
    # kind, B, K, V, N, seeds
    ("random", 3, 15, 300, 16, (0,)),
    ("random", 1, 15, 400, 64, (3,)),
    ("random", 5, 1, 300, 64, (4,)),
    ("random", 1, 15, 1000, 33, (5,)),
    ("random", 5, 4, 100, 32, (6,)),
    ("random", 5, 15, 50, 2, (7,)),
    ("random", 5, 15, 50, 3, (8,)),
    ("random", 1, 31, 100, 64, (9,)),  # the deepest block (32 slots)
    ("random", 3, 15, 2, 64, (10,)),  # W = V = 2 < N - 1
    ("random", 3, 15, 5, 16, (11,)),
    ("ties", 3, 15, 40, 64, (12,)),
    ("ties", 5, 6, 200, 32, (14,)),
    ("ties", 1, 15, 3, 3, (15,)),
    ("sparse", 5, 2, 100, 64, (16,)),  # 3 + 9 real nodes: the rest is padding
    ("sparse", 5, 1, 100, 16, (17,)),
    ("sparse", 1, 15, 100, 16, (18,)),  # zeros among the candidates, no padding left
    ("sampled", 3, 15, 200, 33, (19,)),
    ("sampled", 1, 1, 10, 2, (21,)),
    ("ties", 2, 3, 3000, 64, (22,)),  # candidates from 3 vocabulary chunks (dspine.ops.tree_build.candidates_triton)
    ("sampled", 1, 2, 2500, 16, (23,)),
]


@CPU
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-B{c[1]}K{c[2]}V{c[3]}N{c[4]}")
def test_triton_equals_torch_interpreter(case):
    kind, B, K, V, N, seeds = case
    for seed in seeds:
        got, want = check(kind, B, K, V, N, seed, "cpu")
        paths = sum(3**d for d in range(1, K + 1))
        if kind == "sparse" and paths < N - 1:  # every path of q > 0 is a node, the rest padding
            pad = got.parent[:, 1:] < 0
            assert (pad.sum(1) == N - 1 - paths).all() and (got.depth[:, 1:][pad] == 0).all()
            assert (got.tokens[:, 1:][pad] == 0).all() and not got.chain[:, 1:][pad].any()
        if kind == "sampled":  # chain tokens that are not the argmax are kept first
            chain_nodes = got.tokens[:, 1:][got.chain[:, 1:]].view(B, min(K, N - 1))
            assert torch.equal(chain_nodes, draft(kind, B, K, V, seed)[1][:, : N - 1])


@CPU
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-B{c[1]}K{c[2]}V{c[3]}N{c[4]}")
def test_best_first_triton_equals_torch_interpreter(case):
    """chain_first=False (``_best_first_kernel``): the same tensors as the torch reference on every case, the
    chain flags where the chain nodes scored in; a sampled chain token of q = 0 is never a node."""
    kind, B, K, V, N, seeds = case
    for seed in seeds:
        got, _ = check(kind, B, K, V, N, seed, "cpu", chain_first=False)
        real = got.parent[:, 1:] >= 0
        assert (got.depth[:, 1:][real] >= 1).all() and not got.chain[:, 1:][~real].any()
        assert (got.chain[:, 1:].sum(1) <= min(K, N - 1)).all()


@CPU
def test_best_first_drops_deep_chain_nodes_for_better_siblings():
    """A confident first token, then flat depths: chain_first keeps the whole chain, best first spends the
    budget on depth 1 and 2 (scores: the first token's 0.9 times 0.3 or 0.25 beat 0.9 · 0.3 · 0.3)."""
    q = torch.tensor([[[0.9, 0.05, 0.05, 0.0], [0.3, 0.25, 0.25, 0.2], [0.3, 0.25, 0.25, 0.2]]])
    anchor = torch.tensor([5])
    got = build_tree_fused(anchor, q, 5, chain_first=False)
    assert got.tokens.tolist() == [[5, 0, 0, 1, 2]] and got.parent.tolist() == [[-1, 0, 1, 1, 1]]
    assert got.chain.tolist() == [[True, True, True, False, False]]
    assert_same(got, build_tree_fused(anchor, q, 5, impl="torch", chain_first=False))
    forced = build_tree_fused(anchor, q, 5)
    assert forced.depth.tolist() == [[0, 1, 2, 2, 3]]


@CPU
def test_ties_are_broken_like_torchs_stable_sort():
    """Paths (0, 1) and (1, 0) score log 0.5 + log 0.3 both (fp32 addition commutes: an exact tie) and the
    budget keeps one: the lower flat index, (0, 1) (beam slot 1 at depth 2 before slot 2), as torch's
    stable sort does."""
    q = torch.tensor([[[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]]])
    anchor = torch.tensor([7])
    got = build_tree_fused(anchor, q, 6)
    assert got.tokens.tolist() == [[7, 0, 1, 2, 0, 1]] and got.parent.tolist() == [[-1, 0, 0, 0, 1, 1]]
    assert_same(got, build_tree_fused(anchor, q, 6, impl="torch"))


@CPU
@pytest.mark.parametrize("V,W", [(10, 10), (10, 4), (1500, 33), (2100, 2), (5000, 64)])
def test_candidates_match_a_sort_by_q_then_token_id(V, W):
    """Both candidate paths (``dspine.tree.top_others`` in torch, the two Triton launches) pick the chain token
    and then the W - 1 others by q descending, equal q by lower token id: checked against Python's sort of
    (-q, token) on integer-weight q (many exact ties, zeros) with chain tokens that are not the argmax."""
    from dspine.ops.tree_build import candidates_triton
    from dspine.tree import tree_candidates

    g = torch.Generator().manual_seed(V + W)
    w = torch.randint(0, 3, (2, 3, V), generator=g).float()
    w[..., -1] += 1
    q = w / w.sum(-1, keepdim=True)
    chain = torch.randint(0, V, (2, 3), generator=g)
    for given in (chain, None):  # None: column 0 is the argmax (ties: the lower id, as torch.argmax)
        cand, qv = candidates_triton(q, given, W)
        ref, logq = tree_candidates(torch.zeros(2, dtype=torch.long), q, W + 1, given)
        for b in range(2):
            for k in range(3):
                c = int(chain[b, k]) if given is not None else int(q[b, k].argmax())
                others = sorted((t for t in range(V) if t != c), key=lambda t: (-float(q[b, k, t]), t))
                assert cand[b, k].tolist() == ref[b, k].tolist() == [c] + others[: W - 1]
        assert torch.equal(qv, q.gather(-1, cand)) and torch.equal(qv.log(), logq)


def test_bad_inputs_raise():
    q = torch.softmax(torch.randn(2, 3, 10), -1)
    a = torch.zeros(2, dtype=torch.long)
    for impl in ("triton", "torch"):
        for kwargs, msg in [
            (dict(budget=1), r"budget=1 must be in \[2, 64\]"),
            (dict(budget=65), r"budget=65"),
            (dict(budget=4.0), r"budget must be a Python int, got float 4\.0"),
            (dict(budget=torch.tensor(4)), r"budget must be a Python int, got Tensor"),
            (dict(budget=True), r"budget must be a Python int, got bool"),
            (dict(q=q.bfloat16()), "fp32"),
            (dict(q=q[:, :0]), "1 <= K"),
            (dict(anchor=a.int()), "anchor must be int64"),
            (dict(anchor=a[:1]), r"anchor must be \[2\]"),
            (dict(chain_tokens=torch.zeros(2, 2, dtype=torch.long)), r"chain_tokens \[2, 3\]"),
        ]:
            args = dict(anchor=a, q=q, budget=8, chain_tokens=None) | kwargs
            with pytest.raises(ValueError, match=msg):
                build_tree_fused(**args, impl=impl)
    with pytest.raises(ValueError, match="impl"):
        build_tree_fused(a, q, 8, impl="cuda")


@CPU
def test_bench_tree_build_tiny(tmp_path):
    from benchmarks.kernels import bench_tree_build

    out = tmp_path / "tree.json"
    assert bench_tree_build.main(["--tiny", "--output", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["commit"] and res["triton"]
    assert [(r["B"], r["N"], r["chain_first"]) for r in res["rows"]] == [
        (b, n, cf) for b in (1, 2) for n in (5, 9) for cf in (True, False)]
    assert all(r["equal"] and min(r["torch_us"], r["fused_us"], r["candidates_us"]) > 0 for r in res["rows"])


@pytest.mark.gpu
@pytest.mark.skipif(not env.HAS_CUDA, reason="no CUDA")
def test_triton_equals_torch_cuda():
    """SmolLM2's vocabulary at batch 8, every budget the engine uses; then one CUDA-graph capture replayed
    on new distributions (no host sync inside, fixed shapes)."""
    for kind, seed in (("random", 0), ("ties", 1), ("sampled", 2), ("sparse", 3)):
        for N in (2, 16, 32, 33, 64):
            for chain_first in (True, False):
                check(kind, 8, 15, 49152, N, seed, "cuda", chain_first=chain_first)
    check("random", 64, 31, 1000, 64, 4, "cuda")
    check("random", 64, 31, 1000, 64, 4, "cuda", chain_first=False)
    q, _ = draft("random", 8, 15, 49152, 5, "cuda")
    anchor = torch.arange(8, device="cuda")
    build_tree_fused(anchor, q, 32)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = build_tree_fused(anchor, q, 32)
    for seed in (6, 7):
        q.copy_(draft("ties" if seed == 7 else "random", 8, 15, 49152, seed, "cuda")[0])
        graph.replay()
        assert_same(got, build_tree_fused(anchor, q, 32, impl="torch"))


@CPU
def test_tune_tree_step_tiny(tmp_path):
    """The sweep script's smoke run (interpreter): every variant it times returns the default's result."""
    from benchmarks.kernels import tune_tree_step

    out = tmp_path / "tune.json"
    assert tune_tree_step.main(["--tiny", "--parts", "candidates,build,attention", "--output", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["commit"] and [r["ok"] for r in res["candidates"]] == [True]
    assert [(r["B"], r["N"]) for r in res["build"]] == [(1, 5), (1, 9)]
    assert all(r["ok"] and r["us"] > 0 for r in res["build"])
    att = res["attention"]
    assert len(att) == 6 and all(r["ok"] for r in att)  # 3 ops x (default split, 16-key chunks)
    assert {r["chunk"] for r in att} == {None, 16}


@CPU
def test_candidates_input_checks_strides_and_negative_zero():
    """candidates_triton refuses bad W / dtype / chain shapes by name, reads a strided q correctly and ranks -0.0
    as 0 (both paths)."""
    from dspine.ops.tree_build import candidates_triton
    from dspine.tree import tree_candidates

    g = torch.Generator().manual_seed(3)
    big = torch.randint(0, 3, (2, 3, 300), generator=g).float()
    big = big / big.sum(-1, keepdim=True)
    q = big[..., ::2]  # last-dim stride 2
    cand, qv = candidates_triton(q, None, 9)
    ref, _ = tree_candidates(torch.zeros(2, dtype=torch.long), q.contiguous(), 10)
    assert torch.equal(cand, ref) and torch.equal(qv, q.gather(-1, cand))
    z = torch.zeros(1, 1, 20)
    z[..., 15:] = 0.2
    z[..., :10] = -0.0
    cand, _ = candidates_triton(z, None, 12)
    ref, _ = tree_candidates(torch.zeros(1, dtype=torch.long), z, 13)
    assert cand[0, 0].tolist() == ref[0, 0].tolist() == [15, 16, 17, 18, 19, *range(7)]
    p = torch.softmax(torch.randn(1, 2, 4), -1)
    for args, msg in [((p, None, 5), r"W=5 .* \[1, V=4\]"), ((p, None, 0), "W=0"), ((p.bfloat16(), None, 2), "fp32"),
                      ((p, torch.zeros(1, 3, dtype=torch.long), 2), r"chain_tok must be int64 \[1, 2\]"),
                      ((p, torch.zeros(1, 2, dtype=torch.int32), 2), "int32")]:
        with pytest.raises(ValueError, match=msg):
            candidates_triton(*args)

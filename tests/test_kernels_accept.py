"""accept_greedy, accept_sample and commit_step: crafted cases, a statistical test that chain
rejection sampling emits the target distribution, and exact Triton == torch agreement."""

import tests.kernel_env as env  # noqa: I001  (must precede the kernel imports)

import pytest
import torch
from scipy import stats

from dspine.ops.accept import accept_greedy, accept_sample, commit_step

CPU = pytest.param("cpu", marks=pytest.mark.skipif(not env.TRITON_CPU, reason=str(env.TRITON_CPU_SKIP)))
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not env.HAS_CUDA, reason="no CUDA")])
DEVICES = [CPU, CUDA]
IMPLS = ["triton", "torch"]


def impl_device(impl, device):
    if impl == "torch" and device == "cuda" and not env.HAS_CUDA:
        pytest.skip("no CUDA")


# ----------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_accept_greedy_crafted(impl, device):
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4]])
    draft = torch.tensor([[5, 6, 7], [9, 6, 7], [5, 6, 0], [1, 2, 3]])
    num, bonus = accept_greedy(draft.to(device), target.to(device), impl=impl)
    assert num.dtype == torch.int32 and bonus.dtype == torch.int64
    assert num.tolist() == [3, 0, 2, 3]  # full, zero (a later match does not count), partial
    assert bonus.tolist() == [8, 5, 7, 4]


@pytest.mark.parametrize("device", DEVICES)
def test_accept_greedy_triton_equals_torch(device):
    g = torch.Generator().manual_seed(0)
    for K in (1, 7, 15, 20):
        draft = torch.randint(0, 2, (50, K), generator=g)
        target = torch.randint(0, 2, (50, K + 1), generator=g)
        target[:10, :K] = draft[:10]
        a = accept_greedy(draft.to(device), target.to(device))
        b = accept_greedy(draft, target, impl="torch")
        assert all(torch.equal(x.cpu(), y) for x, y in zip(a, b))


# ----------------------------------------------------------------------------- sampling


def random_probs(g, *shape, sharp=3.0):
    p = torch.rand(*shape, generator=g) ** sharp
    return p / p.sum(-1, keepdim=True)


def sample_inputs(g, B, K, V, pt_rows, pd_rows):
    """B rows sharing the given per-slot distributions; drafts drawn from p_draft."""
    p_target = pt_rows[None].expand(B, K + 1, V).contiguous()
    p_draft = pd_rows[None].expand(B, K, V).contiguous()
    draft = torch.stack([torch.multinomial(pd_rows[k], B, replacement=True, generator=g) for k in range(K)], 1)
    uniform = torch.rand(B, K, generator=g)
    noise = torch.empty(B, V).exponential_(generator=g)
    return draft, p_target, p_draft, uniform, noise


def first_token(draft, num, bonus):
    return torch.where(num > 0, draft[:, 0], bonus)


def chi2_p(tokens, probs):
    V = probs.numel()
    counts = torch.bincount(tokens, minlength=V).double()
    expected = probs.double() * tokens.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "emitted a token of zero target probability"
    f_exp = expected[keep] / expected[keep].sum() * counts[keep].sum()
    return stats.chisquare(counts[keep].numpy(), f_exp.numpy()).pvalue


@pytest.mark.parametrize("K,V", [(1, 8), (2, 12), (3, 16)])
def test_accept_sample_emits_target_distribution(K, V):
    g = torch.Generator().manual_seed(10 + K)
    B = 100_000
    pt_rows, pd_rows = random_probs(g, K + 1, V), random_probs(g, K, V)
    draft, p_target, p_draft, uniform, noise = sample_inputs(g, B, K, V, pt_rows, pd_rows)
    num, bonus = accept_sample(draft, p_target, p_draft, uniform, noise, impl="torch")
    tok = first_token(draft, num, bonus)
    assert chi2_p(tok, pt_rows[0]) > 0.01
    # acceptance rate of slot 0 is Σ min(p, q)
    rate = (num > 0).double().mean().item()
    assert abs(rate - torch.minimum(pt_rows[0], pd_rows[0]).sum().item()) < 5 * (0.25 / B) ** 0.5
    # the second token, given the first draft was accepted, follows p_target[1] as well
    if K >= 2:
        sel = num >= 1
        tok2 = torch.where(num[sel] >= 2, draft[sel, 1], bonus[sel])
        assert chi2_p(tok2, pt_rows[1]) > 0.01

    # a deliberately wrong variant (bonus from p_target instead of the residual) is caught
    wrong_bonus = (p_target[torch.arange(B), num.long()] / noise).argmax(1)
    assert chi2_p(first_token(draft, num, wrong_bonus), pt_rows[0]) < 1e-6


def test_accept_sample_all_accepted_bonus_from_last_row():
    g = torch.Generator().manual_seed(3)
    B, K, V = 100_000, 2, 10
    pt_rows = random_probs(g, K + 1, V)
    pd_rows = pt_rows[:K].clone()  # q == p: every draft is accepted
    draft, p_target, p_draft, uniform, noise = sample_inputs(g, B, K, V, pt_rows, pd_rows)
    num, bonus = accept_sample(draft, p_target, p_draft, uniform, noise, impl="torch")
    assert (num == K).all()
    assert chi2_p(bonus, pt_rows[K]) > 0.01


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("K,V", [(0, 16), (1, 37), (3, 100), (15, 40), (2, 5000), (1, 9000)])
def test_accept_sample_triton_equals_torch(K, V, device):
    g = torch.Generator().manual_seed(100 + K)
    B = 48
    p_target = random_probs(g, B, K + 1, V, sharp=6.0)
    p_draft = random_probs(g, B, K, V, sharp=6.0)
    p_draft[: B // 2, :, :] = p_target[: B // 2, :K]  # some rows accept everything
    p_target[:, :, V // 2:] *= (torch.rand(B, K + 1, 1, generator=g) < 0.3)  # zero-probability tails
    draft = torch.stack([torch.multinomial(p_draft[:, k], 1, generator=g)[:, 0] for k in range(K)], 1) \
        if K else torch.zeros(B, 0, dtype=torch.int64)
    uniform = torch.rand(B, K, generator=g)
    noise = torch.empty(B, V).exponential_(generator=g)
    args = (draft, p_target, p_draft, uniform, noise)
    ref_num, ref_bonus = accept_sample(*args, impl="torch")
    for splits in (None, 1, 3):  # vocabulary slices per row
        num, bonus = accept_sample(*(x.to(device) for x in args), num_splits=splits)
        assert torch.equal(num.cpu(), ref_num) and torch.equal(bonus.cpu(), ref_bonus)
    assert (p_target[torch.arange(B), ref_num.long(), ref_bonus] > 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_accept_sample_crafted(impl, device):
    V = 6
    pt = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0, 0.0], [0, 0, 0, 1.0, 0, 0]])
    pd = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    noise = torch.ones(3, V)
    # row 0: u·q = 0.9 ≥ p = 0.5 → reject; residual max(p − q, 0) = e_2 → bonus 2
    # row 1: u·q = 0.1 < 0.5 → accept; bonus from p_target[1] = e_3
    # row 2: p_target[0] == p_draft[0] and u = 1 → rejected with a zero residual → from p_target[0]
    pt3 = torch.stack([pt, pt, torch.stack([pd[0], pt[1]])])
    pd3 = pd[None].expand(3, 1, V).contiguous()
    draft = torch.tensor([[1], [1], [1]])
    uniform = torch.tensor([[0.9], [0.1], [1.0]])
    noise[2] = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    num, bonus = accept_sample(*(x.to(device) for x in (draft, pt3, pd3, uniform, noise)), impl=impl)
    assert num.tolist() == [0, 1, 0]
    assert bonus.tolist() == [2, 3, 1]


# ----------------------------------------------------------------------------- commit


def commit_inputs(device, done_dtype=torch.bool):
    K1, L = 4, 12
    block = torch.tensor([[9, 11, 12, 13], [9, 11, 2, 13], [9, 11, 12, 13], [9, 11, 12, 13], [9, 11, 12, 13],
                          [9, 11, 12, 13]])
    state = dict(
        block_tokens=block,
        num_accepted=torch.tensor([3, 3, 0, 2, 3, 1], dtype=torch.int32),
        bonus=torch.tensor([20, 21, 22, 2, 24, 25]),
        out_tokens=torch.full((6, L), -1),
        out_len=torch.tensor([0, 1, 5, 2, 0, 10], dtype=torch.int32),
        max_new=torch.tensor([12, 12, 12, 12, 12, 11], dtype=torch.int32),
        done=torch.tensor([0, 0, 0, 0, 1, 0]).to(done_dtype),
        eos_ids=torch.tensor([2, 7]),
        hist=torch.zeros(6, K1 + 1, dtype=torch.int32),
        anchor=torch.full((6,), 9),
    )
    return {k: v.to(device) for k, v in state.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("done_dtype", [torch.bool, torch.int8, torch.int32], ids=str)
def test_commit_step_crafted(impl, device, done_dtype):
    s = commit_inputs(device, done_dtype)
    commit_step(**s, impl=impl)
    out = s["out_tokens"].cpu()
    # row 0: full accept: 3 drafts + bonus
    assert out[0, :5].tolist() == [11, 12, 13, 20, -1]
    # row 1: EOS (2) inside the accepted prefix: 11, 2 written, rest cut
    assert out[1, :4].tolist() == [-1, 11, 2, -1]
    # row 2: zero accepted: only the bonus
    assert out[2, 5:7].tolist() == [22, -1]
    # row 3: EOS as the bonus
    assert out[3, 2:6].tolist() == [11, 12, 2, -1]
    # row 4: already done: untouched
    assert out[4].tolist() == [-1] * 12
    # row 5: max_new = 11 with 10 written: one token only
    assert out[5, 10:].tolist() == [11, -1]
    assert s["out_len"].cpu().tolist() == [4, 3, 6, 5, 0, 11]
    assert s["done"].cpu().tolist() == [False, True, False, True, True, True]
    assert s["done"].dtype == done_dtype
    h = s["hist"].cpu()
    assert h.sum(1).tolist() == [1, 1, 1, 1, 0, 1]
    assert h.argmax(1)[[0, 1, 2, 3, 5]].tolist() == [4, 2, 1, 3, 1]
    assert s["anchor"].cpu().tolist() == [20, 21, 22, 2, 9, 25]  # the bonus, except the row already done


@pytest.mark.parametrize("device", DEVICES)
def test_commit_step_random_triton_equals_torch(device):
    g = torch.Generator().manual_seed(7)
    B, K1, L = 64, 6, 20
    state = dict(
        block_tokens=torch.randint(0, 6, (B, K1), generator=g),
        num_accepted=torch.randint(0, K1, (B,), generator=g).int(),
        bonus=torch.randint(0, 6, (B,), generator=g),
        out_tokens=torch.full((B, L), -1),
        out_len=torch.randint(0, L + 1, (B,), generator=g).int(),
        max_new=torch.randint(0, L + 4, (B,), generator=g).int(),  # some beyond L: capped at L
        done=torch.rand(B, generator=g) < 0.2,
        eos_ids=torch.tensor([4]),
        hist=torch.randint(0, 3, (B, K1 + 1), generator=g).int(),
        anchor=torch.randint(0, 6, (B,), generator=g),
    )
    ref = {k: v.clone() for k, v in state.items()}
    got = {k: v.clone().to(device) for k, v in state.items()}
    commit_step(**ref, impl="torch")
    commit_step(**got)
    for k in state:
        assert torch.equal(got[k].cpu(), ref[k]), k
    # τ bookkeeping: Σ n·hist[n] grows by exactly the tokens written
    n = torch.arange(K1 + 1)
    assert ((ref["hist"] - state["hist"]) * n).sum() == (ref["out_len"] - state["out_len"]).sum()
    assert (ref["out_len"] <= torch.minimum(state["max_new"].clamp_min(state["out_len"]), torch.tensor(L))).all()

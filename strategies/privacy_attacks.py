"""Privacy attacks (the ``privacy_attacks`` kind) and how their results are scored.

Reconstruction from a client's update, the server's view: the attacker knows the global model
the client started from, the update it sent and the local training the scenario sets (the
learning rate, the number of steps, the client's sample count), and looks for inputs and
labels whose simulated update matches the one received.

* :class:`DLG` (Zhu, Liu, Han, "Deep leakage from gradients", NeurIPS 2019): dummy inputs and
  soft labels, L-BFGS on the squared distance between the dummy and the received update;
  ``labels: infer`` is iDLG (Zhao, Mopuri, Bilen, "iDLG: improved deep leakage from
  gradients", 2020): the labels read off the output layer's bias update (a sample's own class
  is the one entry whose cross-entropy gradient is negative), only the inputs optimised.
* :class:`InvertingGradients` (Geiping, Bauermeister, Droege, Moeller, "Inverting gradients:
  how easy is it to break privacy in federated learning?", NeurIPS 2020): cosine distance
  plus ``tv`` times the total variation of image inputs, Adam on the signed gradient with the
  step cut by 10 at 3/8, 5/8 and 7/8 of the budget, the inputs kept in the data's range,
  labels inferred as iDLG does, the best of ``restarts`` starts.

Both simulate ``steps`` full-batch SGD steps of the client's local training on the dummy
data (Geiping et al.'s attack on FedAvg; with ``steps: 1`` and a client's whole data in one
batch it is FedSGD, the setting of both papers). Departures: the client's minibatch order,
momentum and weight decay are not simulated (the attacker does not know the minibatches;
plain SGD is assumed), and labels for more samples than classes are inferred by repeating
the most negative entries (Geiping et al. assume the labels known).

Membership from the final model: :class:`LossThreshold` (Yeom, Giacomelli, Fredrikson, Jha,
"Privacy risk in machine learning", CSF 2018): a member has a lower loss; the score is the
negative loss. :class:`LiRA` (Carlini, Chien, Nasr, Song, Terzis, Tramer, "Membership
inference attacks from first principles", S&P 2022): shadow runs, each training on a seeded
half of the candidate samples; a candidate's logit-scaled confidence in the target run
against Gaussians fitted to it in the shadow runs that trained on it and in those that did
not (:func:`lira_scores`).

Scoring (the engine's, with the data the attacker never sees): PSNR of each reconstructed
input against the client's samples, matched one to one by the Hungarian method on PSNR
(``match``), SSIM (Wang, Bovik, Sheikh, Simoncelli 2004) for image inputs, label accuracy,
and Hayes, Mahloujifar, Balle's reconstruction success ("Bounding training data
reconstruction in DP-SGD", NeurIPS 2023): among ``candidates`` samples (the target and
others from the training data), the reconstruction's nearest is the target.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import numpy as np
import torch
from annotated_types import Ge, Gt, Le
from torch import nn
from torch.func import functional_call

from strategies.protocols import AttackResult, AttackView, PrivacyAttack, Traits

# ---------------------------------------------------------------- simulating the update


def soft_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of ``logits`` against probability rows ``targets``."""
    return -(targets * torch.log_softmax(logits, dim=1)).sum(dim=1).mean()


def simulated_update(model: nn.Module, x: torch.Tensor, targets: torch.Tensor, lr: float,
                     steps: int) -> torch.Tensor:
    """The model delta of ``steps`` full-batch SGD steps at ``lr`` on ``(x, targets)`` from
    the model's parameters (differentiable in ``x`` and ``targets``), flat in
    ``model.parameters()``'s order."""
    start = {k: v.detach().requires_grad_(True) for k, v in model.named_parameters()}
    p = dict(start)
    for _ in range(max(steps, 1)):
        loss = soft_cross_entropy(functional_call(model, p, (x,)), targets)
        grads = torch.autograd.grad(loss, list(p.values()), create_graph=True)
        p = {k: v - lr * g for (k, v), g in zip(p.items(), grads, strict=True)}
    return torch.cat([(p[k] - start[k]).reshape(-1) for k in start])


def infer_labels(model: nn.Module, update: torch.Tensor, samples: int,
                 num_classes: int) -> torch.Tensor:
    """iDLG's labels: the output layer's bias update is ``-lr`` times the mean of
    softmax - one-hot over the batch, so the classes present have its largest entries;
    the ``samples`` largest, the order repeated when there are more samples than classes
    (the output bias: the last parameter with ``num_classes`` entries; without one, the
    last weight matrix's row sums)."""
    params = list(model.parameters())
    offsets = np.cumsum([0] + [p.numel() for p in params])
    last = next((i for i in reversed(range(len(params)))
                 if params[i].dim() == 1 and params[i].numel() == num_classes), None)
    if last is not None:
        bias = update[offsets[last]:offsets[last + 1]]
    else:
        i = next(i for i in reversed(range(len(params))) if params[i].dim() == 2
                 and params[i].shape[0] == num_classes)
        bias = update[offsets[i]:offsets[i + 1]].reshape(params[i].shape).sum(dim=1)
    order = torch.argsort(bias, descending=True, stable=True)  # the update is -lr * grad
    return order[torch.arange(samples) % num_classes]


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """The mean absolute difference of neighbouring pixels over the last two dimensions of
    image inputs (zero for flat inputs)."""
    if x.dim() < 3:
        return x.new_zeros(())
    return (x[..., 1:, :] - x[..., :-1, :]).abs().mean() + \
        (x[..., :, 1:] - x[..., :, :-1]).abs().mean()


# ---------------------------------------------------------------- the attacks


def dlg(view: AttackView, generator: torch.Generator, iterations: int = 300,
        lr: float = 1.0, labels: str = "optimize") -> AttackResult:
    """DLG (iDLG with ``labels="infer"``): L-BFGS with ``iterations`` function evaluations
    on the squared distance between the dummy data's simulated update and the received
    one, both divided by the local learning rate (gradients, for FedSGD). The dummy inputs
    live in the data's range through a sigmoid (a departure: the paper's are unbounded,
    and on a linear model L-BFGS then runs off to saturated logits)."""
    assert view.update is not None
    target = view.update.detach().to(torch.float32) / view.lr
    n = view.samples
    lo, hi = view.input_range
    z = torch.randn((n, *view.input_shape), generator=generator).requires_grad_(True)
    fixed = labels == "infer"
    if fixed:
        y = nn.functional.one_hot(infer_labels(view.model, view.update, n, view.num_classes),
                                  view.num_classes).to(torch.float32)
        variables = [z]
    else:
        y_logits = torch.randn((n, view.num_classes), generator=generator).requires_grad_(True)
        variables = [z, y_logits]
    opt = torch.optim.LBFGS(variables, lr=lr, max_iter=iterations,
                            max_eval=iterations, history_size=100,
                            tolerance_grad=1e-12, tolerance_change=1e-15,
                            line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        soft = y if fixed else torch.softmax(y_logits, dim=1)
        x = lo + (hi - lo) * torch.sigmoid(z)
        diff = simulated_update(view.model, x, soft, view.lr, view.steps) / view.lr - target
        loss = (diff * diff).sum()
        loss.backward()
        return loss

    opt.step(closure)
    out_labels = (y if fixed else y_logits).detach().argmax(dim=1)
    return AttackResult(inputs=(lo + (hi - lo) * torch.sigmoid(z)).detach(), labels=out_labels)


def inverting_gradients(view: AttackView, generator: torch.Generator, iterations: int = 1000,
                        lr: float = 0.1, tv: float = 1e-4, restarts: int = 1
                        ) -> AttackResult:
    """Inverting Gradients: ``restarts`` starts of ``iterations`` signed Adam steps on
    1 - cos(simulated update, received update) + ``tv`` TV(x), x kept in the data's range;
    the start with the smallest final loss."""
    assert view.update is not None
    target = view.update.detach().to(torch.float32)
    n = view.samples
    y = nn.functional.one_hot(infer_labels(view.model, view.update, n, view.num_classes),
                              view.num_classes).to(torch.float32)
    lo, hi = view.input_range
    best: tuple[float, torch.Tensor] | None = None
    for _ in range(restarts):
        x = torch.randn((n, *view.input_shape), generator=generator)
        x = (lo + (hi - lo) * torch.sigmoid(x)).requires_grad_(True)
        opt = torch.optim.Adam([x], lr=lr * (hi - lo))
        cuts = [int(iterations * f) for f in (3 / 8, 5 / 8, 7 / 8)]
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=cuts, gamma=0.1)
        loss = torch.zeros(())
        for _ in range(iterations):
            opt.zero_grad()
            u = simulated_update(view.model, x, y, view.lr, view.steps)
            loss = 1 - nn.functional.cosine_similarity(u, target, dim=0) + \
                tv * total_variation(x)
            loss.backward()
            assert x.grad is not None
            x.grad.sign_()
            opt.step()
            sched.step()
            with torch.no_grad():
                x.clamp_(lo, hi)
        final = float(loss.detach())
        if best is None or final < best[0]:
            best = (final, x.detach().clone())
    assert best is not None
    return AttackResult(inputs=best[1], labels=y.argmax(dim=1))


def loss_threshold(view: AttackView) -> AttackResult:
    """The negative cross-entropy of the final model on each query (a member's is higher)."""
    assert view.queries is not None
    x, y = view.queries
    with torch.no_grad():
        losses = nn.functional.cross_entropy(view.model(x), y, reduction="none")
    return AttackResult(scores=-losses)


def logit_confidence(view: AttackView) -> AttackResult:
    """Carlini et al.'s score of each query on the final model: the logit-scaled confidence
    of its label, log p_y - log(1 - p_y), computed from the logits z as z_y - logsumexp of
    the other classes' z (no p rounded to 1)."""
    assert view.queries is not None
    x, y = view.queries
    with torch.no_grad():
        z = view.model(x).double()
    own = z.gather(1, y.view(-1, 1)).squeeze(1)
    others = z.scatter(1, y.view(-1, 1), -math.inf).logsumexp(dim=1)
    return AttackResult(scores=own - others)


def balanced_inclusion(rng: np.random.Generator, candidates: int, runs: int) -> np.ndarray:
    """``(runs, candidates)`` bool: which runs train on each candidate, exactly ``runs // 2``
    of them for every candidate, a random choice each (Carlini et al.'s experiments)."""
    return rng.random((runs, candidates)).argsort(axis=0) < runs // 2


def lira_scores(target: np.ndarray, shadows: np.ndarray, included: np.ndarray,
                online: bool = True, variance: str = "global") -> np.ndarray:
    """LiRA's membership score of each candidate (Carlini et al., S&P 2022, Algorithm 1):
    ``target`` ``(m,)`` the target model's logit-scaled confidences, ``shadows`` ``(r, m)``
    the shadow models', ``included`` ``(r, m)`` which shadows trained on each candidate.
    Online: log N(target; mu_in, s_in^2) - log N(target; mu_out, s_out^2), the means the
    medians of the candidate's IN and OUT shadow scores (as the authors' code); offline
    (no IN shadows needed): log P[N(mu_out, s_out^2) <= target], the one-sided test of the
    paper. ``variance``: ``global``, one variance for IN and one for OUT pooled over the
    candidates (the paper's choice below 64 shadows), or ``per_example``. A candidate
    without IN (or OUT) shadows takes the IN (OUT) mean of all candidates.

    Departure from the authors' code: the global variance pools each candidate's scores
    about its own mean (theirs takes the variance of all IN scores together, which adds the
    spread of the candidates' means); no query augmentations."""
    from scipy.stats import norm

    target = np.asarray(target, dtype=np.float64)
    shadows = np.asarray(shadows, dtype=np.float64)
    included = np.asarray(included, dtype=bool)

    def fit(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        has = mask.any(axis=0)  # candidates with scores on this side
        vals = np.where(mask, shadows, np.nan)[:, has]
        medians = np.nanmedian(vals, axis=0)
        mu = np.full(len(target), medians.mean() if has.any() else 0.0)
        mu[has] = medians
        spread = np.nanmean((vals - np.nanmean(vals, axis=0)) ** 2, axis=0)
        if variance == "global":
            sd = np.full(len(target), np.sqrt(spread.mean()) if has.any() else 1.0)
        else:
            sd = np.full(len(target), np.sqrt(np.median(spread)) if has.any() else 1.0)
            sd[has] = np.sqrt(spread)
        return mu, np.maximum(sd, 1e-6)

    mu_out, sd_out = fit(~included)
    if not online:
        return norm.logcdf((target - mu_out) / sd_out)
    mu_in, sd_in = fit(included)
    return norm.logpdf(target, mu_in, sd_in) - norm.logpdf(target, mu_out, sd_out)


class _Reconstruction(PrivacyAttack):
    """The keys every reconstruction attack has: which round (1-based) and client, what it
    targets, its iteration budget; and ``candidates``, the size of the prior set its
    success is scored on (Hayes et al.'s kappa = 1 / candidates)."""

    traits = Traits(reconstructs=True)

    def __init__(self, round: Annotated[int, Ge(1)] = 1,
                 client: Annotated[int, Ge(0)] | None = None,
                 target: Literal["update", "release"] = "update",
                 iterations: Annotated[int, Ge(1)] = 300,
                 candidates: Annotated[int, Ge(2)] = 10) -> None:
        self.round, self.client, self.target = round, client, target
        self.iterations, self.candidates = iterations, candidates


class DLG(_Reconstruction):
    """Deep Leakage from Gradients (Zhu, Liu, Han, NeurIPS 2019; ``labels: infer``: iDLG,
    Zhao et al. 2020): :func:`dlg`. Departure: the update is matched, K simulated steps
    for a K-step client (the paper matches one gradient)."""

    def __init__(self, round: Annotated[int, Ge(1)] = 1,
                 client: Annotated[int, Ge(0)] | None = None,
                 target: Literal["update", "release"] = "update",
                 iterations: Annotated[int, Ge(1)] = 300,
                 candidates: Annotated[int, Ge(2)] = 10,
                 lr: Annotated[float, Gt(0)] = 1.0,
                 labels: Literal["optimize", "infer"] = "optimize") -> None:
        super().__init__(round, client, target, iterations, candidates)
        self.lr, self.labels = lr, labels

    def attack(self, view: AttackView, generator: torch.Generator) -> AttackResult:
        return dlg(view, generator, self.iterations, self.lr, self.labels)


class InvertingGradients(_Reconstruction):
    """Inverting Gradients (Geiping et al., NeurIPS 2020): :func:`inverting_gradients`.
    Departures: labels inferred (the paper assumes them known); one budget, no
    augmentations."""

    def __init__(self, round: Annotated[int, Ge(1)] = 1,
                 client: Annotated[int, Ge(0)] | None = None,
                 target: Literal["update", "release"] = "update",
                 iterations: Annotated[int, Ge(1)] = 1000,
                 candidates: Annotated[int, Ge(2)] = 10,
                 lr: Annotated[float, Gt(0)] = 0.1,
                 tv: Annotated[float, Ge(0)] = 1e-4,
                 restarts: Annotated[int, Ge(1)] = 1) -> None:
        super().__init__(round, client, target, iterations, candidates)
        self.lr, self.tv, self.restarts = lr, tv, restarts

    def attack(self, view: AttackView, generator: torch.Generator) -> AttackResult:
        return inverting_gradients(view, generator, self.iterations, self.lr, self.tv,
                                   self.restarts)


class LossThreshold(PrivacyAttack):
    """Membership inference by loss threshold (Yeom et al., CSF 2018): :func:`loss_threshold`
    on the final model, training samples against held-out test samples."""

    def attack(self, view: AttackView, generator: torch.Generator) -> AttackResult:
        return loss_threshold(view)


class LiRA(PrivacyAttack):
    """The likelihood-ratio attack (Carlini, Chien, Nasr, Song, Terzis, Tramer, "Membership
    inference attacks from first principles", S&P 2022) with ``runs`` runs of the scenario
    (each a sweep point): ``candidates`` training samples, each trained on in half of the
    runs; each run scores them on its final model (:func:`logit_confidence`), and ``fedray
    privacy shadows`` scores each run's candidates against the other runs
    (:func:`lira_scores`, ``online`` or offline, ``variance`` global or per example).
    Departures: no query augmentations; the runs of one seed share its data split (the
    candidates must be the same samples), each trains from its own seeds."""

    def __init__(self, runs: Annotated[int, Ge(4), Le(1024)] = 16,
                 run: Annotated[int, Ge(0)] | None = None,
                 candidates: Annotated[int, Ge(2)] = 500,
                 online: bool = True,
                 variance: Literal["global", "per_example"] = "global") -> None:
        self.runs, self.run, self.candidates = runs, run, candidates
        self.online, self.variance = online, variance

    def attack(self, view: AttackView, generator: torch.Generator) -> AttackResult:
        return logit_confidence(view)

    def combine(self, target: np.ndarray, shadows: np.ndarray, included: np.ndarray
                ) -> np.ndarray:
        return lira_scores(target, shadows, included, self.online, self.variance)


# ---------------------------------------------------------------- scoring


def psnr(a: torch.Tensor, b: torch.Tensor, data_range: float) -> torch.Tensor:
    """PSNR in dB of every row of ``a`` against every row of ``b``: ``(len(a), len(b))``
    (infinite for identical rows)."""
    fa, fb = a.reshape(len(a), -1).double(), b.reshape(len(b), -1).double()
    mse = torch.cdist(fa, fb).pow(2) / fa.shape[1]
    return 10 * torch.log10(data_range ** 2 / mse)


def match(rec: torch.Tensor, truth: torch.Tensor, data_range: float) -> np.ndarray:
    """For each true sample, the reconstruction matched to it (Hungarian on PSNR)."""
    from scipy.optimize import linear_sum_assignment

    score = psnr(truth, rec, data_range).clamp(max=1e6).numpy()
    rows, cols = linear_sum_assignment(-score)
    out = np.empty(len(truth), dtype=np.int64)
    out[rows] = cols
    return out


def ssim(a: torch.Tensor, b: torch.Tensor, data_range: float) -> torch.Tensor:
    """SSIM of each image of ``a`` against the same-index image of ``b`` (``(n, C, H, W)`` or
    ``(n, H, W)``): a Gaussian window of sigma 1.5 (11 pixels, fewer for small images),
    C1 = (0.01 L)^2, C2 = (0.03 L)^2, averaged over pixels and channels (Wang et al.)."""
    if a.dim() == 3:
        a, b = a.unsqueeze(1), b.unsqueeze(1)
    a, b = a.double(), b.double()
    size = min(11, a.shape[-1], a.shape[-2])
    size -= 1 - size % 2  # odd
    t = torch.arange(size, dtype=torch.float64) - size // 2
    g = torch.exp(-t ** 2 / (2 * 1.5 ** 2))
    g = g / g.sum()
    win = (g[:, None] * g[None, :]).expand(a.shape[1], 1, size, size)

    def blur(z: torch.Tensor) -> torch.Tensor:
        return nn.functional.conv2d(z, win, groups=a.shape[1])

    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    ma, mb = blur(a), blur(b)
    va, vb, cov = blur(a * a) - ma ** 2, blur(b * b) - mb ** 2, blur(a * b) - ma * mb
    s = ((2 * ma * mb + c1) * (2 * cov + c2)) / ((ma ** 2 + mb ** 2 + c1) * (va + vb + c2))
    return s.mean(dim=(1, 2, 3))


def membership_scores(scores: np.ndarray, member: np.ndarray) -> tuple[float, float, float]:
    """(AUC, advantage, threshold): the area under the ROC curve of ``scores`` for telling
    members (``member`` True) from non-members, ties counted half, and the best threshold's
    TPR - FPR (a score at least the threshold: "member"), with that threshold. The best
    advantage of a sample is biased up (the max over thresholds of noisy differences):
    measure a threshold chosen here on other queries (:func:`advantage_at`)."""
    from scipy.stats import rankdata

    scores = np.asarray(scores, dtype=np.float64)
    member = np.asarray(member, dtype=bool)
    n1, n0 = int(member.sum()), int((~member).sum())
    ranks = rankdata(scores)
    auc = (ranks[member].sum() - n1 * (n1 + 1) / 2) / (n1 * n0)
    order = np.argsort(-scores, kind="stable")
    s, m = scores[order], member[order]
    gap = np.cumsum(m) / n1 - np.cumsum(~m) / n0
    gap[np.r_[s[1:] == s[:-1], False]] = -np.inf  # thresholds between distinct scores only
    best = int(np.argmax(gap))
    if gap[best] <= 0:
        return float(auc), 0.0, math.inf  # no threshold beats calling nobody a member
    return float(auc), float(gap[best]), float(s[best])


def advantage_at(scores: np.ndarray, member: np.ndarray, threshold: float) -> float:
    """TPR - FPR of calling a score at least ``threshold`` a member."""
    scores = np.asarray(scores, dtype=np.float64)
    member = np.asarray(member, dtype=bool)
    said = scores >= threshold
    return float(said[member].mean() - said[~member].mean())


def auc_advantage(scores: np.ndarray, member: np.ndarray, rng: np.random.Generator
                  ) -> dict[str, float]:
    """A membership attack's ``auc`` and ``advantage``: TPR - FPR of the best threshold on
    half the members and half the non-members (``rng``'s choice), measured on the others
    (an unbiased estimate, which may be below 0)."""
    half = np.zeros(len(scores), bool)
    for side in (np.flatnonzero(member), np.flatnonzero(~member)):
        half[side[rng.permutation(len(side))[: len(side) // 2]]] = True
    _, _, threshold = membership_scores(scores[half], member[half])
    auc, _, _ = membership_scores(scores, member)
    return {"auc": auc, "advantage": advantage_at(scores[~half], member[~half], threshold)}


def tpr_at_fpr(scores: np.ndarray, member: np.ndarray, fpr: float) -> float:
    """The largest TPR of a threshold whose FPR is at most ``fpr`` (a score above the
    threshold: "member"; Carlini et al.'s low-FPR measure). With n non-members an FPR below
    1 / n allows no false positive."""
    scores = np.asarray(scores, dtype=np.float64)
    member = np.asarray(member, dtype=bool)
    order = np.argsort(-scores, kind="stable")
    s, m = scores[order], member[order]
    tp, fp = np.cumsum(m) / max(m.sum(), 1), np.cumsum(~m) / max((~m).sum(), 1)
    cut = np.r_[s[1:] != s[:-1], True]  # a threshold takes every tied score
    ok = cut & (fp <= fpr)
    return float(tp[ok].max()) if ok.any() else 0.0


def nearest_is_target(rec: torch.Tensor, candidates: torch.Tensor) -> bool:
    """Hayes et al.'s success: the candidate nearest to the reconstruction ``rec`` (l2) is
    the first one, the target."""
    d = torch.cdist(rec.reshape(1, -1).double(), candidates.reshape(len(candidates), -1).double())
    return int(d.argmin()) == 0


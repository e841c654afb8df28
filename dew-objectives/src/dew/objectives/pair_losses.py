"""Preference losses of one pair, as pure functions of the completions' log-probabilities.

``h`` is the difference of log-ratios to the reference,
(log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)), summed over
each completion's tokens; ``beta`` scales it. Each function returns one loss
per pair.

- ``sigmoid`` (DPO, Rafailov et al. 2023; with label smoothing eps, cDPO):
  -(1 - eps) log s(beta h) - eps log s(-beta h)
- ``hinge`` (SLiC-HF, Zhao et al. 2023): max(0, 1 - beta h)
- ``ipo`` (Azar et al. 2023): (h - 1 / (2 beta))^2
- ``robust`` (rDPO, Chowdhury et al. 2024): (-(1 - eps) log s(beta h) + eps log s(-beta h)) / (1 - 2 eps)
- ``bco_pair`` (BCO, Jung et al. 2024): -log s(beta r_w - delta) - log s(-(beta r_l - delta)),
  r the log-ratio of each completion and delta a running mean of the rewards beta r
- ``orpo`` (Hong et al. 2024): the chosen's mean token NLL plus
  lambda * -log s(log odds(y_w) - log odds(y_l)), odds(y) = P / (1 - P) with P the
  completion's mean token probability exp(mean log p); no reference
- ``cpo`` (Xu et al. 2024): -log s(beta (log pi(y_w) - log pi(y_l))) + alpha * NLL(y_w); no reference
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["bco_pair", "cpo", "hinge", "ipo", "log_odds", "orpo", "robust", "running_mean", "sigmoid"]


def sigmoid(h: jax.Array, beta: float, label_smoothing: float = 0.0) -> jax.Array:
    """DPO's logistic loss, with cDPO's label smoothing."""
    eps = label_smoothing
    return -(1.0 - eps) * jax.nn.log_sigmoid(beta * h) - eps * jax.nn.log_sigmoid(-beta * h)


def hinge(h: jax.Array, beta: float) -> jax.Array:
    """SLiC's hinge on the scaled difference of log-ratios."""
    return jax.nn.relu(1.0 - beta * h)


def ipo(h: jax.Array, beta: float) -> jax.Array:
    """IPO's squared distance of h from 1 / (2 beta)."""
    return (h - 1.0 / (2.0 * beta)) ** 2


def robust(h: jax.Array, beta: float, label_smoothing: float) -> jax.Array:
    """rDPO: the logistic loss unbiased for preferences flipped with probability label_smoothing."""
    eps = label_smoothing
    return (-(1.0 - eps) * jax.nn.log_sigmoid(beta * h) + eps * jax.nn.log_sigmoid(-beta * h)) / (1.0 - 2.0 * eps)


def running_mean(mean: jax.Array, count: jax.Array, values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The mean of everything seen, after adding values: (count * mean + sum(values)) / (count + n).

    >>> m, n = running_mean(jnp.float32(1.0), jnp.float32(2.0), jnp.array([4.0]))
    >>> float(m), float(n)
    (2.0, 3.0)
    """
    n = jnp.asarray(values.size, jnp.float32)
    total = count + n
    return mean + (jnp.mean(values) - mean) * n / total, total


def bco_pair(chosen_ratio: jax.Array, rejected_ratio: jax.Array, beta: float, delta: jax.Array) -> jax.Array:
    """BCO on a pair: each completion classified against the reward shift delta."""
    return (-jax.nn.log_sigmoid(beta * chosen_ratio - delta)
            - jax.nn.log_sigmoid(-(beta * rejected_ratio - delta)))


def log_odds(mean_logp: jax.Array) -> jax.Array:
    """log(P / (1 - P)) for P = exp(mean_logp), with P kept below 1 so the odds stay finite."""
    mean_logp = jnp.minimum(mean_logp, -1e-6)
    return mean_logp - jnp.log(-jnp.expm1(mean_logp))


def orpo(chosen_mean_logp: jax.Array, rejected_mean_logp: jax.Array, lam: float) -> tuple[jax.Array, jax.Array]:
    """ORPO's loss per pair and its log-odds ratio: NLL(y_w) - lam * log s(log odds(y_w) - log odds(y_l))."""
    ratio = log_odds(chosen_mean_logp) - log_odds(rejected_mean_logp)
    return -chosen_mean_logp - lam * jax.nn.log_sigmoid(ratio), ratio


def cpo(chosen_logp: jax.Array, rejected_logp: jax.Array, chosen_mean_logp: jax.Array, beta: float,
        alpha: float) -> jax.Array:
    """CPO's loss per pair: the reference-free logistic loss on summed log-probabilities, plus alpha NLL(y_w)."""
    return -jax.nn.log_sigmoid(beta * (chosen_logp - rejected_logp)) - alpha * chosen_mean_logp

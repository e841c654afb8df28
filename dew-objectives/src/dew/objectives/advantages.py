"""Generalized advantage estimation over completion tokens, on the host.

Position ``j`` of a sequence's predictions (``tokens[:, j + 1]`` given
``tokens[:, :j + 1]``) is one time step. Only positions where ``mask`` is 1
(the completion) take part: a completion's last token ends the episode, so
the value after it counts as 0.

    delta_j = r_j + gamma * V_{j+1} - V_j
    A_j = delta_j + gamma * lambda * A_{j+1},   returns_j = A_j + V_j
"""

from __future__ import annotations

import numpy as np

__all__ = ["gae"]


def gae(rewards: np.ndarray, values: np.ndarray, mask: np.ndarray, *, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """Advantages and returns [B, T] for rewards, values and mask [B, T] (zero off the mask).

    >>> a, r = gae(np.array([[0.0, 1.0]]), np.array([[0.5, 0.5]]), np.ones((1, 2)), gamma=1.0, lam=1.0)
    >>> a.tolist(), r.tolist()
    ([[0.5, 0.5]], [[1.0, 1.0]])
    """
    rewards, values, mask = (np.asarray(x, np.float64) for x in (rewards, values, mask))
    advantages = np.zeros_like(rewards)
    following = np.zeros(rewards.shape[0])  # A_{j+1}
    next_value = np.zeros(rewards.shape[0])  # V_{j+1} (0 past the completion's end)
    for j in range(rewards.shape[1] - 1, -1, -1):
        m = mask[:, j]
        delta = rewards[:, j] + gamma * next_value - values[:, j]
        current = delta + gamma * lam * following
        advantages[:, j] = current * m
        following = np.where(m > 0, current, following)
        next_value = np.where(m > 0, values[:, j], next_value)
    returns = (advantages + values) * mask
    return advantages.astype(np.float32), returns.astype(np.float32)

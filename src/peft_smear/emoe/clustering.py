"""Balanced k-means over an FFN's keys: every expert gets exactly ``d_ff / N`` neurons, as EMoE needs.

Lloyd's iterations, with the assignment step solved *exactly* under the size constraint (a transportation problem:
each key goes to one cluster, each cluster takes exactly ``size`` keys). Rather than a general min-cost-flow solver
(``k-means-constrained`` pulls in OR-Tools for that), the exact step starts from a greedy balanced assignment and
cancels negative cycles in the small graph between clusters: moving one key from cluster ``a`` to ``b`` costs
``cost[key, b] - cost[key, a]``, and a balanced assignment is optimal exactly when no cycle of such moves has a
negative total (the optimality condition of min-cost flow). The graph has ``N`` nodes whatever the FFN width, so
each check is a few vectorised numpy operations. Only numpy is needed, and everything is seeded.
"""

from __future__ import annotations

import numpy as np


def balanced_kmeans(
    points: np.ndarray, num_clusters: int, seed: int = 0, max_iter: int = 100, n_init: int = 3
) -> np.ndarray:
    """Labels ``[n]`` (``int64`` in ``[0, num_clusters)``, each used exactly ``n / num_clusters`` times) of the
    balanced k-means of ``points`` ``[n, dim]`` with the lowest within-cluster sum of squares over ``n_init``
    k-means++ starts. Deterministic for a given ``seed``."""
    points = np.asarray(points, dtype=np.float64)
    n = points.shape[0]
    if num_clusters < 1 or n % num_clusters:
        raise ValueError(f"Cannot split {n} points into {num_clusters} clusters of equal size.")
    rng = np.random.default_rng(seed)
    best_labels, best_inertia = None, np.inf
    for _ in range(n_init):
        centroids = _kmeans_plus_plus(points, num_clusters, rng)
        labels = None
        for _ in range(max_iter):
            new_labels = balanced_assignment(_squared_distances(points, centroids), start=labels)
            if labels is not None and np.array_equal(new_labels, labels):
                break
            labels = new_labels
            centroids = _centroids(points, labels, num_clusters)
        inertia = within_cluster_sum_of_squares(points, labels, num_clusters)
        if inertia < best_inertia - 1e-12:
            best_labels, best_inertia = labels, inertia
    return best_labels


def random_partition(n: int, num_clusters: int, seed: int = 0) -> np.ndarray:
    """Labels of a seeded random partition of ``n`` items into ``num_clusters`` equal groups (the paper's table 4
    ablation: experts made of random neurons)."""
    if num_clusters < 1 or n % num_clusters:
        raise ValueError(f"Cannot split {n} items into {num_clusters} groups of equal size.")
    labels = np.empty(n, dtype=np.int64)
    labels[np.random.default_rng(seed).permutation(n)] = np.repeat(np.arange(num_clusters), n // num_clusters)
    return labels


def balanced_assignment(cost: np.ndarray, start: np.ndarray | None = None) -> np.ndarray:
    """The assignment of ``n`` items to ``N`` clusters, exactly ``n / N`` each, with the least total ``cost[item,
    cluster]`` (``[n, N]``). ``start``: a balanced assignment to improve (else a greedy one is built)."""
    n, num_clusters = cost.shape
    size = n // num_clusters
    labels = _greedy_assignment(cost, size) if start is None else start.copy()
    # members[c]: the items of cluster c, kept as an [N, size] table so moves are slot swaps.
    members = np.argsort(labels, kind="stable").reshape(num_clusters, size)
    tolerance = 1e-9 * (np.abs(cost).max() + 1.0)
    rows = np.arange(num_clusters)
    while True:
        member_cost = cost[members]  # [N, size, N]
        moves = member_cost - member_cost[rows, :, rows][:, :, None]  # cost of moving each member to each cluster
        best_slot = moves.argmin(axis=1)  # [from, to]: the cheapest member to move
        weights = np.take_along_axis(moves, best_slot[:, None, :], axis=1)[:, 0, :]
        np.fill_diagonal(weights, 0.0)
        cycle = _negative_cycle(weights, tolerance)
        if cycle is None:
            break
        moved = [(a, b, members[a, best_slot[a, b]]) for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True)]
        for a, b, item in moved:
            members[a, best_slot[a, b]] = -1 - item  # vacate the slot (marked) before filling it
        for _, b, item in moved:
            slot = np.flatnonzero(members[b] < 0)[0]
            members[b, slot] = item
            labels[item] = b
    return labels


def within_cluster_sum_of_squares(points: np.ndarray, labels: np.ndarray, num_clusters: int) -> float:
    """k-means' objective: the squared distance of every point to its cluster's mean, summed."""
    points = np.asarray(points, dtype=np.float64)
    centroids = _centroids(points, labels, num_clusters)
    return float(((points - centroids[labels]) ** 2).sum())


def _negative_cycle(weights: np.ndarray, tolerance: float) -> list[int] | None:
    """A cycle of negative total weight in the complete directed graph ``weights[from, to]``, as its node list, or
    ``None``: Bellman-Ford from a virtual source joined to every node."""
    num_nodes = weights.shape[0]
    distance = np.zeros(num_nodes)
    parent = np.full(num_nodes, -1)
    for _ in range(num_nodes + 1):
        candidate = distance[:, None] + weights  # [from, to]
        best_from = candidate.argmin(axis=0)
        best = candidate[best_from, np.arange(num_nodes)]
        improved = best < distance - tolerance
        if not improved.any():
            return None
        distance[improved] = best[improved]
        parent[improved] = best_from[improved]
    node = int(np.flatnonzero(improved)[0])
    for _ in range(num_nodes):  # walk back far enough to stand on the cycle
        node = int(parent[node])
    cycle = [node]
    while (node := int(parent[node])) != cycle[0]:
        cycle.append(node)
    cycle.reverse()  # parent edges point backwards: reversed, the list follows the moves
    total = sum(weights[a, b] for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True))
    return cycle if total < -tolerance else None


def _greedy_assignment(cost: np.ndarray, size: int) -> np.ndarray:
    """A balanced assignment: the cheapest (item, cluster) pairs first, while the cluster has room."""
    n, num_clusters = cost.shape
    labels = np.full(n, -1, dtype=np.int64)
    room = np.full(num_clusters, size)
    for flat in np.argsort(cost, axis=None, kind="stable"):
        item, cluster = divmod(int(flat), num_clusters)
        if labels[item] < 0 and room[cluster]:
            labels[item] = cluster
            room[cluster] -= 1
    return labels


def _kmeans_plus_plus(points: np.ndarray, num_clusters: int, rng: np.random.Generator) -> np.ndarray:
    """Greedy k-means++: each new centroid is the best of ``2 + log N`` candidates drawn by squared distance (the
    candidate that lowers the potential most), which gave lower final sums of squares than one draw."""
    trials = 2 + int(np.log(num_clusters))
    centroids = [points[rng.integers(points.shape[0])]]
    closest = ((points - centroids[0]) ** 2).sum(axis=1)
    for _ in range(1, num_clusters):
        total = closest.sum()
        if total <= 0:
            candidates = rng.integers(points.shape[0], size=trials)
        else:
            candidates = rng.choice(points.shape[0], size=trials, p=closest / total)
        distances = _squared_distances(points, points[candidates])  # [n, trials]
        potentials = np.minimum(closest[:, None], distances).sum(axis=0)
        best = int(potentials.argmin())
        centroids.append(points[candidates[best]])
        closest = np.minimum(closest, distances[:, best])
    return np.stack(centroids)


def _squared_distances(points: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    return ((points**2).sum(axis=1)[:, None] - 2.0 * points @ centroids.T + (centroids**2).sum(axis=1)[None, :]).clip(
        min=0.0
    )


def _centroids(points: np.ndarray, labels: np.ndarray, num_clusters: int) -> np.ndarray:
    sums = np.zeros((num_clusters, points.shape[1]))
    np.add.at(sums, labels, points)
    return sums / np.bincount(labels, minlength=num_clusters)[:, None]

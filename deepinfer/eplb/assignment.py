"""Maximum-score assignment of rows to columns (the Hungarian algorithm), small and dependency-free."""

from __future__ import annotations

INF = float("inf")


def max_score_assignment(score: list[list[float]]) -> list[int]:
    """Column of each row in a perfect matching of the square `score` matrix with the largest total score.

    Shortest augmenting paths with row/column potentials, O(n^3). Invariant: after row i is added, rows 1..i
    are matched and every reduced cost -score[r][c] - u[r] - v[c] is >= 0, tight (== 0) on matched pairs.
    """
    n = len(score)
    u, v = [0.0] * (n + 1), [0.0] * (n + 1)
    match = [0] * (n + 1)  # match[j]: row (1-based) matched to column j; 0 = free. Column 0 is the path's root.
    for i in range(1, n + 1):
        match[0], way = i, [0] * (n + 1)
        minv, used, j0 = [INF] * (n + 1), [False] * (n + 1), 0
        while match[j0]:
            used[j0], i0, delta, j1 = True, match[j0], INF, 0
            for j in range(1, n + 1):
                if not used[j]:
                    reduced = -score[i0 - 1][j - 1] - u[i0] - v[j]
                    if reduced < minv[j]:
                        minv[j], way[j] = reduced, j0
                    if minv[j] < delta:
                        delta, j1 = minv[j], j
            for j in range(n + 1):
                if used[j]:
                    u[match[j]] += delta
                    v[j] -= delta
                else:
                    minv[j] -= delta
            j0 = j1
        while j0:  # flip the augmenting path back to the root
            match[j0] = match[way[j0]]
            j0 = way[j0]
    col = [0] * n
    for j in range(1, n + 1):
        col[match[j] - 1] = j - 1
    return col

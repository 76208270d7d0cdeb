"""`gateway-dev bench --runs N`: several runs as one result.

Every run is a whole bench run (every policy on fresh key prefixes, then the
plain-Celery comparison), evaluated on its own.  The combined result keeps them
all (``runs``) and adds, per policy and for the plain comparison, the spread of
each headline number (bench/headline.py) as median, min and max over the runs
(``spread``); the targets are judged on the medians, and each target and check
says how many of the runs passed it (``runs_passed``).
"""

from __future__ import annotations

from typing import Any, Sequence

from devtools.bench.headline import plain_headline, policy_headline
from devtools.bench.report import add_targets, policy_checks, target_shares
from devtools.measure import spread


def spread_tree(trees: Sequence[Any]) -> Any:
    """The same nested dict from several runs, with each number replaced by its spread."""
    if isinstance(trees[0], dict):
        return {key: spread_tree([tree[key] for tree in trees]) for key in trees[0]}
    return spread(trees)


def medians(tree: Any) -> Any:
    """A spread tree back in the headline's shape, each number its median."""
    if "median" in tree:
        return tree["median"]
    return {key: medians(value) for key, value in tree.items()}


def runs_passing_check(results: Sequence[dict[str, Any]], policy: str, check: str) -> int:
    return sum(bool(r["policies"][policy]["checks"][check]["ok"]) for r in results)


def runs_passing_target(results: Sequence[dict[str, Any]], target: str) -> int:
    return sum(bool(t["ok"]) for r in results for t in r["targets"] if t["target"] == target)


def headline_spread(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """{"policies": {policy: spread tree}, "plain_celery": spread tree (when it ran)}."""
    out: dict[str, Any] = {"policies": {
        policy: spread_tree([policy_headline(r["policies"][policy]) for r in results])
        for policy in results[0]["policies"]}}
    if results[0].get("plain_celery"):
        out["plain_celery"] = spread_tree([plain_headline(r["plain_celery"]) for r in results])
    return out


def median_checks(results: Sequence[dict[str, Any]], spreads: dict[str, Any]) -> dict[str, Any]:
    """Per policy, the checks on its median headline, each with how many runs passed it."""
    shares = target_shares(results[0]["config"]["tiers"])
    checks = {}
    for policy, tree in spreads["policies"].items():
        checks[policy] = policy_checks(medians(tree), shares)
        for name, check in checks[policy].items():
            check["runs_passed"] = runs_passing_check(results, policy, name)
    return checks


def combine(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One JSON document for several evaluated runs (see the module docstring)."""
    spreads = headline_spread(results)
    checks = median_checks(results, spreads)
    plain = spreads.get("plain_celery")
    combined: dict[str, Any] = {
        "config": {**results[0]["config"], "runs": len(results)},
        "runs": list(results),
        "spread": spreads,
        "checks": checks,
        "runtime_s": round(sum(r["runtime_s"] for r in results), 1),
    }
    add_targets(combined, checks, medians(plain) if plain else None)
    for target in combined["targets"]:
        target["runs_passed"] = runs_passing_target(results, target["target"])
    return combined

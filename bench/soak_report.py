"""The printed summary of bench/soak.py, and what makes the soak fail."""

from __future__ import annotations

from bench import common
from bench.soak_checks import describe


def report(r: dict) -> None:
    req, mem = r["requests"], r["memory"]
    print(
        f"\nsoak: {r['duration_s'] / 60:.1f} min, {req['total']} requests, {req['served']} served "
        f"({req['qps_served']:.1f}/s)"
    )
    common.print_table(["status", "count"], sorted(req["by_status"].items(), key=lambda kv: -kv[1]))
    print()
    common.print_table(["control call -> outcome", "count"], sorted(r["control"].items()))
    print()
    rows = [
        [
            action,
            sum(outcomes.values()),
            ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items(), key=lambda kv: -kv[1])),
        ]
        for action, outcomes in r["actions"].items()
    ]
    common.print_table(["chaos action", "count", "outcomes"], rows)
    print()
    common.print_table(["event", "count"], [*sorted(r["kills"].items()), *sorted(r["log"].items())])
    print()
    growth = mem["rss_growth"]
    names = sorted(set(mem["start"]["rss_bytes"]) | set(mem["end"]["rss_bytes"]))
    rows = [
        [
            n + (" (restarted)" if growth.get(n, {}).get("restarted") else ""),
            mem["start"]["rss_bytes"].get(n, 0) / 1e6,
            mem["end"]["rss_bytes"].get(n, 0) / 1e6,
            float(growth[n]["growth_mb"]) if n in growth else "",
        ]
        for n in names
    ]
    rows += [
        ["total RSS", mem["start"]["rss_total_bytes"] / 1e6, mem["end"]["rss_total_bytes"] / 1e6, ""],
        ["/dev/shm (segments)", float(mem["start"]["shm_segments"]), float(mem["end"]["shm_segments"]), ""],
        ["/dev/shm MB", mem["start"]["shm_bytes"] / 1e6, mem["end"]["shm_bytes"] / 1e6, ""],
    ]
    common.print_table(["memory (MB)", "start", "end", "growth"], rows, floatfmt=".1f")
    slow = ", ".join(f"{x['ms']:.0f} ms at {x['started_s']:.0f} s" for x in r["slowest_served"][:3])
    print(f"\nslowest served: {slow}; incidents recorded: {len(r['incidents'])} (see the JSON)")
    rec = r["recovery"]
    print(
        f"\nrecovery: {rec['seconds']:.1f} s of at most {rec['budget_s']:.0f} s, {rec['attempts']} attempt(s), "
        f"continued {rec['continued'] or 'nothing'}; stages at its start: {describe(rec['stages_at_start'])}"
    )
    print(f"every stage serving: {'yes' if rec['succeeded'] else 'no'}; last attempt: {rec['last_attempt']}")
    for line in rec["diagnosis"]:
        print(f"  {line}")
    s = r["stop"]
    print(
        f"\nstop: exit code {s['exit_code']}, segments left {len(s['segments_left'])}, "
        f"processes left {len(s['processes_left'])}"
    )
    if r["failures"]:
        print(f"FAILED: {'; '.join(r['failures'])}")


def failures(r: dict) -> list[str]:
    """Why the soak fails: the mesh did not recover, did not stop cleanly, or left something behind."""
    s, out = r["stop"], []
    if not r["recovery"]["succeeded"]:
        out.append("the mesh did not recover")
    if s["exit_code"] != 0:
        out.append(f"`up` exited with {s['exit_code']}")
    if s["segments_left"]:
        out.append(f"{len(s['segments_left'])} /dev/shm segment(s) left")
    if s["processes_left"]:
        out.append(f"{len(s['processes_left'])} process(es) left alive")
    return out

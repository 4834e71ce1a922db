"""The named figures: what each measures, its target, and the baseline it is paired with.

The Tether names are a contract (issue 5): other checks read them from the JSON, so they
never change. Baseline and peer rows carry a dotted prefix (`baseline.`, `peer.`) so that
they can never collide with a Tether name. Every ratio is `value / baseline_value`, so a
peer row paired with the same floor as a Tether row reads on the same scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Op = Literal["<=", ">="]
Stat = Literal["p50", "p99"]


@dataclass(frozen=True)
class Target:
    op: Op
    limit: float

    def holds(self, value: float) -> bool:
        return value <= self.limit if self.op == "<=" else value >= self.limit

    def __str__(self) -> str:
        return f"{self.op} {self.limit:g}"


@dataclass(frozen=True)
class Case:
    """One measurement process: `func` is an import string of a case generator."""

    name: str
    func: str
    reps: tuple[int, int]  # (quick, full)
    timeout: tuple[float, float]  # seconds for the whole case process, (quick, full)
    optional: bool = False  # a missing package skips it with a note instead of failing
    # One process per repetition: memory figures must not inherit a previous repetition's
    # freed-but-kept heap, which would flatter every repetition after the first.
    fresh_process_per_rep: bool = False
    # Too long for --quick (a million sessions): `make bench-full` only, or --quick with
    # the figure or case named exactly in --only.
    full_only: bool = False


@dataclass(frozen=True)
class Figure:
    name: str
    case: str
    series: str
    stat: Stat
    unit: str
    target: Target | None = None
    baseline: str | None = None
    ratio_target: Target | None = None


def _c(
    name: str,
    func: str,
    reps: tuple[int, int],
    timeout: tuple[float, float],
    optional: bool = False,
    fresh: bool = False,
    full_only: bool = False,
) -> Case:
    return Case(name, f"benchmarks.{func}", reps, timeout, optional, fresh, full_only)


CASES: dict[str, Case] = {
    c.name: c
    for c in (
        _c("tether.abort", "tether_cases:abort", (3, 7), (90, 400)),
        # Issue 19: cgroup containment; skipped with a note where no cgroup v2 is writable.
        _c("tether.abort_cgroup", "tether_cases:abort_cgroup", (3, 7), (90, 400), optional=True),
        _c("tether.abort_loaded", "tether_cases:abort_loaded", (2, 5), (120, 500)),
        # Issue 19: a subtree abort of 100 running turns (100 workers: a fresh tree each
        # sample, the pool refilled in between).
        _c("tether.subtree_abort_100", "tether_cases:subtree_abort_100", (2, 3), (300, 900)),
        _c("tether.respawn", "tether_cases:respawn", (3, 7), (90, 400)),
        _c("tether.cancel_signal", "tether_cases:cancel_signal", (3, 7), (60, 300)),
        _c("tether.boundary_stop", "tether_cases:boundary_stop", (3, 7), (60, 300)),
        _c("tether.turns", "tether_cases:turns", (3, 7), (90, 400)),
        _c("tether.sends", "tether_cases:sends", (3, 7), (60, 300)),
        _c("tether.sessions_100", "tether_cases:sessions_100", (3, 7), (60, 300)),
        # Two quick repetitions of each large case: a repetition is a fresh process that
        # spawns every session again, and the memory figures barely move between them.
        _c("tether.sessions_10k", "tether_cases:sessions_10k", (2, 5), (150, 900), fresh=True),
        _c("tether.sessions_100k", "tether_cases:sessions_100k", (2, 5), (300, 1500), fresh=True),
        _c(
            "tether.sessions_1m",
            "tether_cases:sessions_1m",
            (1, 1),
            (1800, 1800),
            fresh=True,
            full_only=True,
        ),
        _c("tether.pause_resume", "tether_cases:pause_resume", (3, 7), (60, 300)),
        _c("tether.pause_cgroup", "tether_cases:pause_cgroup", (3, 7), (60, 300), optional=True),
        _c("tether.watchdog_overhead", "tether_cases:watchdog_overhead", (3, 7), (120, 600)),
        # Issue 30: host CPU per turn with telemetry on vs off (needs tether-runtime[otel]).
        _c(
            "tether.telemetry_overhead",
            "tether_cases:telemetry_overhead",
            (3, 7),
            (120, 600),
            optional=True,
        ),
        # Issue 29: budgets. A crossing report → a 10-session tree stopped; and the host
        # CPU that usage reports cost.
        _c("tether.budget_stop", "tether_cases:budget_stop", (2, 5), (180, 600)),
        _c("tether.usage_overhead", "tether_cases:usage_overhead", (3, 7), (120, 600)),
        # Issue 30: the abort with telemetry off and on, alternately, same run.
        _c(
            "tether.telemetry_abort",
            "tether_cases:telemetry_abort",
            (3, 5),
            (120, 600),
            optional=True,
        ),
        # Issue 46: the terminal UI, an event → its row drawn, 100 events/s over 1,000
        # sessions (tether-runtime[tui]; skipped with a note without Textual).
        _c(
            "tether.tui_event_to_screen",
            "tui_cases:tui_event_to_screen",
            (3, 5),
            (240, 600),
            optional=True,
        ),
        # Issue 18: the MCP client's cancel reaching a real stdio server (tether-runtime[agents]).
        _c("tether.mcp_cancel", "mcp_cases:mcp_cancel", (3, 7), (120, 600), optional=True),
        # Issue 18: the agent kit against the model server (needs tether-runtime[agents]).
        _c(
            "tether.cancel_inflight",
            "agent_cases:cancel_inflight",
            (3, 7),
            (90, 400),
            optional=True,
        ),
        _c(
            "tether.cancel_inflight_sync",
            "agent_cases:cancel_inflight_sync",
            (2, 5),
            (120, 500),
            optional=True,
        ),
        _c("tether.agent_turn", "agent_cases:agent_turn", (3, 7), (90, 400), optional=True),
        # Issue 27: the framework adapters' cancel, each with its extra. Claude Code starts
        # its CLI for every turn (about 1.5 s here, outside the timed span), so it takes 8
        # samples a repetition in --quick, the others 20 as cancel_inflight.
        _c(
            "tether.adapter_cancel_pydantic_ai",
            "adapter_cases:adapter_cancel_pydantic_ai",
            (3, 7),
            (120, 500),
            optional=True,
        ),
        _c(
            "tether.adapter_cancel_openai_agents",
            "adapter_cases:adapter_cancel_openai_agents",
            (3, 7),
            (120, 500),
            optional=True,
        ),
        _c(
            "tether.adapter_cancel_claude_code",
            "adapter_cases:adapter_cancel_claude_code",
            (2, 5),
            (240, 900),
            optional=True,
        ),
        _c(
            "baseline.claude_interrupt",
            "adapter_cases:claude_interrupt_floor",
            (2, 5),
            (240, 900),
            optional=True,
        ),
        _c("baseline.stream", "agent_cases:stream_floor", (3, 7), (60, 300), optional=True),
        _c("baseline.killpg", "baselines:killpg_floor", (3, 7), (60, 300)),
        _c("baseline.msgspec_rtt", "baselines:msgspec_rtt", (3, 7), (30, 120)),
        _c("baseline.mp_pool", "baselines:mp_pool", (3, 7), (60, 300)),
        _c("baseline.sqlite", "baselines:sqlite_commit", (3, 7), (30, 120)),
        # One quick repetition: 10,000 thread starts are slow on a small VM, and the
        # figure barely moves between repetitions (thread stacks dominate it).
        _c("baseline.pykka_actor_mem", "baselines:pykka_actor_mem", (1, 3), (60, 300), fresh=True),
        _c("peer.anyio", "peers:anyio_hard_stop", (3, 7), (60, 300), optional=True),
        _c("peer.pykka", "peers:pykka_peer", (3, 7), (30, 120), optional=True),
        _c("peer.thespian", "peers:thespian_peer", (3, 7), (60, 300), optional=True),
        _c("peer.ray", "peers:ray_peer", (3, 5), (150, 600), optional=True),
        # Tether on Ray (issue 12); skipped with a note when Ray (tether-runtime[ray]) is absent.
        _c("tether.ray", "ray_cases:ray_backend", (2, 5), (300, 900), optional=True),
        _c("tether.ray_cgroup", "ray_cases:ray_backend_cgroup", (2, 5), (300, 900), optional=True),
    )
}

_LE: Op = "<="
_GE: Op = ">="

FIGURES: list[Figure] = [
    # --- Tether (exact names; other checks read them) ---
    # Targets follow issue 8: where a baseline from the same run exists, the target is a
    # ratio to it (these machines vary 40x between runs); absolute limits remain where the
    # issue states one. Pairings with no ratio target are shown for context only.
    Figure(
        "abort_p50_ms",
        "tether.abort",
        "abort_ms",
        "p50",
        "ms",
        Target(_LE, 10),
        "baseline.killpg_reap_p50_ms",
    ),
    Figure(
        "abort_p99_ms",
        "tether.abort",
        "abort_ms",
        "p99",
        "ms",
        Target(_LE, 30),
        "baseline.killpg_reap_p99_ms",
    ),
    # Issue 19: the same abort under containment="cgroup", its tree holding an env-cleared
    # setsid escapee (dead and recorded); read next to the walk's abort_p50_ms.
    Figure(
        "abort_cgroup_p50_ms",
        "tether.abort_cgroup",
        "abort_ms",
        "p50",
        "ms",
        baseline="abort_p50_ms",
    ),
    Figure(
        "abort_cgroup_p99_ms",
        "tether.abort_cgroup",
        "abort_ms",
        "p99",
        "ms",
        baseline="abort_p99_ms",
    ),
    # Issue 19: one subtree abort call on 100 running turns → all 100 recorded aborted;
    # read next to one turn's abort.
    Figure(
        "subtree_abort_100_ms",
        "tether.subtree_abort_100",
        "abort_ms",
        "p50",
        "ms",
        baseline="abort_p50_ms",
    ),
    Figure(
        "abort_p99_ms_loaded",
        "tether.abort_loaded",
        "abort_ms",
        "p99",
        "ms",
        Target(_LE, 30),
        "baseline.killpg_reap_p99_ms",
    ),
    Figure(
        "cancel_signal_p50_us",
        "tether.cancel_signal",
        "signal_us",
        "p50",
        "us",
        None,
        "baseline.msgspec_socketpair_rtt_p50_us",
        Target(_LE, 4),
    ),
    Figure("boundary_stop_p50_ms", "tether.boundary_stop", "stop_ms", "p50", "ms", Target(_LE, 3)),
    Figure(
        "turns_per_s",
        "tether.turns",
        "turns_per_s",
        "p50",
        "/s",
        None,
        "baseline.mp_pool_tasks_per_s",
        Target(_GE, 0.2),
    ),
    # Host process CPU only (workers excluded), over the same batches as turns_per_s.
    Figure(
        "host_cpu_us_per_turn",
        "tether.turns",
        "host_cpu_us",
        "p50",
        "us",
        Target(_LE, 100),
        "baseline.mp_pool_parent_cpu_us_per_task",
    ),
    Figure(
        "sends_per_s",
        "tether.sends",
        "sends_per_s",
        "p50",
        "/s",
        None,
        "baseline.sqlite_insert_commit_per_s",
        Target(_GE, 0.8),
    ),
    # The same durable sends from 8 caller threads: what group commit buys.
    Figure(
        "sends_8_callers_per_s",
        "tether.sends",
        "sends_8_per_s",
        "p50",
        "/s",
        None,
        "baseline.sqlite_insert_commit_per_s",
        Target(_GE, 1.5),
    ),
    Figure(
        "interrupt_call_p50_us_100",
        "tether.sessions_100",
        "interrupt_call_us",
        "p50",
        "us",
        Target(_LE, 150),
    ),
    # Paired with the 100-session figure: the ratio is the "no scan" check (within 1.5x).
    Figure(
        "interrupt_call_p50_us_10k",
        "tether.sessions_10k",
        "interrupt_call_us",
        "p50",
        "us",
        Target(_LE, 150),
        "interrupt_call_p50_us_100",
        Target(_LE, 1.5),
    ),
    Figure(
        "interrupt_call_p50_us_100k",
        "tether.sessions_100k",
        "interrupt_call_us",
        "p50",
        "us",
        Target(_LE, 150),
        "interrupt_call_p50_us_100",
        Target(_LE, 1.5),
    ),
    Figure("list_10k_ms", "tether.sessions_10k", "list_ms", "p50", "ms", Target(_LE, 20)),
    Figure("list_100k_ms", "tether.sessions_100k", "list_ms", "p50", "ms", Target(_LE, 100)),
    Figure(
        "idle_session_kib",
        "tether.sessions_100k",
        "idle_session_kib",
        "p50",
        "KiB",
        Target(_LE, 4),
        "baseline.pykka_actor_kib",
        Target(_LE, 0.2),
    ),
    Figure(
        "spawn_per_s",
        "tether.sessions_100k",
        "spawn_per_s",
        "p50",
        "/s",
        None,
        "baseline.sqlite_insert_commit_per_s",
        Target(_GE, 0.5),
    ),
    Figure("close_100k_s", "tether.sessions_100k", "close_s", "p50", "s", Target(_LE, 5)),
    Figure("sessions_1m_rss_gib", "tether.sessions_1m", "rss_gib", "p50", "GiB", Target(_LE, 4)),
    Figure("list_1m_ms", "tether.sessions_1m", "list_ms", "p50", "ms"),
    Figure(
        "interrupt_call_p50_us_1m",
        "tether.sessions_1m",
        "interrupt_call_us",
        "p50",
        "us",
        None,
        "interrupt_call_p50_us_100",
        Target(_LE, 1.5),
    ),
    Figure("respawn_ms", "tether.respawn", "respawn_ms", "p50", "ms", Target(_LE, 30)),
    # Issue 9: pause → every process of a sh+sleep tree stopped; resume → none stopped.
    Figure(
        "pause_p50_ms",
        "tether.pause_resume",
        "pause_ms",
        "p50",
        "ms",
        Target(_LE, 10),
        "baseline.killpg_reap_p50_ms",
    ),
    Figure("resume_p50_ms", "tether.pause_resume", "resume_ms", "p50", "ms", Target(_LE, 10)),
    # Issue 19: pause under containment="cgroup" → the leaf says frozen 1.
    Figure(
        "pause_cgroup_p50_ms",
        "tether.pause_cgroup",
        "pause_ms",
        "p50",
        "ms",
        baseline="pause_p50_ms",
    ),
    Figure(
        "watchdog_overhead_pct",
        "tether.watchdog_overhead",
        "overhead_pct",
        "p50",
        "%",
        Target(_LE, 5),
    ),
    Figure(
        "telemetry_overhead_pct",
        "tether.telemetry_overhead",
        "overhead_pct",
        "p50",
        "%",
        Target(_LE, 5),
    ),
    # Issue 29: the usage report that crosses a tree's budget (stamped in its worker) →
    # every running turn of a 10-session tree recorded stopped (a boundary every 1 ms);
    # read next to one turn's boundary stop.
    Figure(
        "budget_stop_p50_ms",
        "tether.budget_stop",
        "stop_ms",
        "p50",
        "ms",
        baseline="boundary_stop_p50_ms",
    ),
    # Host CPU per turn with a usage report after each of its 3 steps (under a budget)
    # vs none, same run, alternately.
    Figure(
        "usage_frame_overhead_pct",
        "tether.usage_overhead",
        "overhead_pct",
        "p50",
        "%",
        Target(_LE, 5),
    ),
    # Issue 30: a traced worker is aborted as fast as an untraced one (same run).
    Figure("telemetry_abort_off_p50_ms", "tether.telemetry_abort", "abort_ms", "p50", "ms"),
    Figure("telemetry_abort_off_p99_ms", "tether.telemetry_abort", "abort_ms", "p99", "ms"),
    Figure(
        "telemetry_abort_on_p50_ms",
        "tether.telemetry_abort",
        "abort_traced_ms",
        "p50",
        "ms",
        baseline="telemetry_abort_off_p50_ms",
        ratio_target=Target(_LE, 1.25),
    ),
    Figure(
        "telemetry_abort_on_p99_ms",
        "tether.telemetry_abort",
        "abort_traced_ms",
        "p99",
        "ms",
        baseline="telemetry_abort_off_p99_ms",
    ),
    # Issue 12, backend="ray": no targets of their own; read them next to the local rows
    # and next to peer.ray_cancel_force_p50_ms (Ray's own stop, which leaves escapees).
    Figure("ray_turn_p50_ms", "tether.ray", "turn_ms", "p50", "ms"),
    Figure(
        "ray_abort_p50_ms",
        "tether.ray",
        "abort_ms",
        "p50",
        "ms",
        baseline="peer.ray_cancel_force_p50_ms",
    ),
    # Issue 19: the same abort with each slot's turn in a cgroup leaf; the target is a
    # ratio to Ray's own stop (which leaves the escapees running).
    Figure(
        "ray_abort_cgroup_p50_ms",
        "tether.ray_cgroup",
        "abort_ms",
        "p50",
        "ms",
        None,
        "peer.ray_cancel_force_p50_ms",
        Target(_LE, 0.5),
    ),
    Figure(
        "ray_abort_p99_ms",
        "tether.ray",
        "abort_ms",
        "p99",
        "ms",
        baseline="baseline.killpg_reap_p99_ms",
    ),
    # Issue 46: an event (its server-side ts) → the terminal UI's row of that session drawn,
    # under 100 events a second over a tree of 1,000 sessions.
    Figure(
        "tui_event_to_screen_p50_ms",
        "tether.tui_event_to_screen",
        "event_to_screen_ms",
        "p50",
        "ms",
        Target(_LE, 100),
    ),
    # Issue 18: cancel of an MCP call → the stdio server received notifications/cancelled
    # for it; paired, for context, with a whole echo call's round trip on the same pipe.
    Figure(
        "mcp_cancel_p50_ms",
        "tether.mcp_cancel",
        "cancel_ms",
        "p50",
        "ms",
        Target(_LE, 20),
        "baseline.mcp_echo_rtt_p50_ms",
    ),
    # Issue 18: a cancel reaching inside a model request (async ChatAgent mid-stream; the
    # server's recorded disconnect precedes the turn's end), the same stop of a sync
    # driver (the grace kill, for contrast), and what a one-reply agent turn adds.
    Figure(
        "cancel_inflight_p50_ms",
        "tether.cancel_inflight",
        "cancel_ms",
        "p50",
        "ms",
        Target(_LE, 10),
        "baseline.openai_stream_cancel_p50_ms",
    ),
    # Issue 27: the same ChatAgent cancels, timed from the call to the disconnect the
    # server records: what the adapters' figures below are compared with, like for like.
    Figure(
        "cancel_inflight_disconnect_p50_ms",
        "tether.cancel_inflight",
        "disconnect_ms",
        "p50",
        "ms",
        baseline="baseline.openai_stream_cancel_p50_ms",
    ),
    # Issue 27: a framework agent's turn cancelled mid-stream (the same hung reply), the
    # call to the server's recorded disconnect; the turn ended cancelled, its partial kept.
    Figure(
        "adapter_cancel_p50_ms_pydantic_ai",
        "tether.adapter_cancel_pydantic_ai",
        "disconnect_ms",
        "p50",
        "ms",
        None,
        "cancel_inflight_disconnect_p50_ms",
        Target(_LE, 2),
    ),
    Figure(
        "adapter_cancel_p50_ms_openai_agents",
        "tether.adapter_cancel_openai_agents",
        "disconnect_ms",
        "p50",
        "ms",
        None,
        "cancel_inflight_disconnect_p50_ms",
        Target(_LE, 2),
    ),
    Figure(
        "adapter_cancel_p50_ms_claude_code",
        "tether.adapter_cancel_claude_code",
        "disconnect_ms",
        "p50",
        "ms",
        None,
        "cancel_inflight_disconnect_p50_ms",
        Target(_LE, 2),
    ),
    Figure(
        "cancel_inflight_sync_p50_ms",
        "tether.cancel_inflight_sync",
        "cancel_ms",
        "p50",
        "ms",
        None,
        "cancel_inflight_p50_ms",
    ),
    Figure(
        "agent_turn_overhead_ms",
        "tether.agent_turn",
        "overhead_ms",
        "p50",
        "ms",
        Target(_LE, 5),
        "baseline.openai_request_overhead_ms",
    ),
    # --- baselines (floors measured in the same run) ---
    Figure("baseline.mcp_echo_rtt_p50_ms", "tether.mcp_cancel", "echo_rtt_ms", "p50", "ms"),
    Figure("baseline.killpg_reap_p50_ms", "baseline.killpg", "kill_ms", "p50", "ms"),
    Figure("baseline.killpg_reap_p99_ms", "baseline.killpg", "kill_ms", "p99", "ms"),
    Figure("baseline.msgspec_socketpair_rtt_p50_us", "baseline.msgspec_rtt", "rtt_us", "p50", "us"),
    Figure("baseline.mp_pool_tasks_per_s", "baseline.mp_pool", "tasks_per_s", "p50", "/s"),
    Figure(
        "baseline.mp_pool_parent_cpu_us_per_task", "baseline.mp_pool", "parent_cpu_us", "p50", "us"
    ),
    Figure("baseline.sqlite_insert_commit_per_s", "baseline.sqlite", "commits_per_s", "p50", "/s"),
    Figure("baseline.pykka_actor_kib", "baseline.pykka_actor_mem", "actor_kib", "p50", "KiB"),
    Figure("baseline.openai_stream_cancel_p50_ms", "baseline.stream", "cancel_ms", "p50", "ms"),
    Figure("baseline.openai_request_overhead_ms", "baseline.stream", "overhead_ms", "p50", "ms"),
    # Issue 27: the SDK's own interrupt of a fresh Claude Code CLI, no Tether (context for
    # adapter_cancel_p50_ms_claude_code, whose target is a ratio to ChatAgent's).
    Figure(
        "baseline.claude_interrupt_p50_ms",
        "baseline.claude_interrupt",
        "disconnect_ms",
        "p50",
        "ms",
    ),
    # What a v1 session cost to start (one pykka actor, one thread each); spawn_per_s is
    # now paired with the SQLite commit rate, since a durable spawn is at least one commit.
    Figure(
        "baseline.pykka_actor_start_per_s", "baseline.pykka_actor_mem", "starts_per_s", "p50", "/s"
    ),
    # --- peers (other runtimes, same run; each paired with the floor its Tether row uses) ---
    Figure(
        "peer.anyio_hard_stop_p50_ms",
        "peer.anyio",
        "cancel_ms",
        "p50",
        "ms",
        baseline="baseline.killpg_reap_p50_ms",
    ),
    Figure(
        "peer.ray_cancel_force_p50_ms",
        "peer.ray",
        "cancel_ms",
        "p50",
        "ms",
        baseline="baseline.killpg_reap_p50_ms",
    ),
    Figure(
        "peer.ray_actor_calls_per_s",
        "peer.ray",
        "calls_per_s",
        "p50",
        "/s",
        baseline="baseline.mp_pool_tasks_per_s",
    ),
    Figure("peer.pykka_ask_p50_us", "peer.pykka", "ask_us", "p50", "us"),
    Figure("peer.pykka_tell_per_s", "peer.pykka", "tells_per_s", "p50", "/s"),
    Figure(
        "peer.thespian_roundtrip_p50_us",
        "peer.thespian",
        "rtt_us",
        "p50",
        "us",
        baseline="baseline.msgspec_socketpair_rtt_p50_us",
    ),
]

FIGURES_BY_NAME: dict[str, Figure] = {f.name: f for f in FIGURES}

"""Running one load case on a live cell: its requests (load/driver.py, by its pattern or the
sweep), then its records: a `call` record per request and a `load` record per load point."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

from pytest_gpubench.config.cases import Case
from pytest_gpubench.config.cell import Cell
from pytest_gpubench.config.datasets import sample_dataset
from pytest_gpubench.config.engine_series import VLLM_PREFIX_HITS, VLLM_PREFIX_QUERIES
from pytest_gpubench.config.load_profile import LoadProfile, dataset_prompt_id
from pytest_gpubench.config.matrix import Matrix, load_dataset_sha256
from pytest_gpubench.config.prompts import Prompt, RequestShape, dataset_prompt
from pytest_gpubench.config.synthetic import synthetic_prompt
from pytest_gpubench.config.traces import Trace, read_trace
from pytest_gpubench.core.provenance import utc_now
from pytest_gpubench.engines import ChatPayloads, Request, merge_body
from pytest_gpubench.ledger.load_figures import LoadFigures
from pytest_gpubench.ledger.records import call_record, load_call_record, load_record, sample_record
from pytest_gpubench.ledger.schema import SyntheticFields, as_json
from pytest_gpubench.measure.control import CpuPressure
from pytest_gpubench.measure.gauges import GaugeScraper
from pytest_gpubench.results.engine_checks import draft_counts
from pytest_gpubench.results.load_summary import (
    adapter_split,
    lag_by_client,
    lost_client_summary,
    summarize_point,
)
from pytest_gpubench.results.percentiles import percentile
from pytest_gpubench.run.load import LoadPattern, make_pattern, ramp_seconds
from pytest_gpubench.run.load.adapters import AdapterChoice
from pytest_gpubench.run.load.clients import Clients, run_clients
from pytest_gpubench.run.load.driver import LoadRun, Sent, SessionPlan, Target, build_target
from pytest_gpubench.run.load.sweep import run_sweep
from pytest_gpubench.run.workloads import exact, exact_facts, trace_texts
from pytest_gpubench.targets import launch_clients, launch_here

if TYPE_CHECKING:
    from pytest_gpubench.run.live_cell import LiveCell


@dataclass
class LoadOutcome:
    """What a load case produced: its main `load` record (the sweep's, or its one point's) and
    every other record (call records, a sweep's per-step load records)."""

    record: dict[str, Any]
    others: list[dict[str, Any]] = field(default_factory=list)


def load_prompt(matrix: Matrix, cell: Cell, prompt_id: str) -> tuple[Prompt, RequestShape]:
    """The prompt a load case sends and its request keys: a synthetic one (fixed output length)
    or a frozen one with the cell's request keys, the output length fixed (ignore_eos) unless
    the cell or prompt says otherwise."""
    assert cell.load is not None
    if cell.load.synthetic is not None and prompt_id == cell.load.synthetic.prompt_id:
        prompt = synthetic_prompt(cell.load.synthetic)
    else:
        prompt = matrix.prompts[prompt_id]
    request = cell.request_for(prompt)
    if request.ignore_eos is None:
        request = request.merged(RequestShape(ignore_eos=True))
    return prompt, request


@dataclass(frozen=True)
class LoadPrompts:
    """What a load case sends: its prompts in turn (one, or a dataset's), the request keys and
    the hash it is frozen by."""

    prompts: tuple[Prompt, ...]
    request: RequestShape
    sha256: str
    # What each prompt's call records carry beside the measurement (a synthetic size's counts).
    facts: tuple[SyntheticFields, ...] = ()


def load_prompts(live: LiveCell, matrix: Matrix, prompt_id: str) -> LoadPrompts:
    """The prompts of a load case: a dataset's sampled ones (their own max_tokens, ended where
    the model ends them unless the cell says ignore_eos), the synthetic sizes made exact on the
    live cell, else load_prompt's one."""
    cell = live.cell
    profile = cell.load
    assert profile is not None
    synthetic = profile.synthetic
    if synthetic is not None and prompt_id == synthetic.prompt_id:
        base, request = load_prompt(matrix, cell, prompt_id)
        texts: list[str] = []
        facts: list[SyntheticFields] = []
        for index, (size, seed) in enumerate(synthetic.variants):
            made = exact(live, size, seed)
            texts.append(made.text)
            facts.append(exact_facts(made))
            if synthetic.prefix is not None:
                # Group g's prefix: its own seeded text (seeds below 0 are never a prompt's).
                group = index % synthetic.prefix.groups
                head = exact(live, synthetic.prefix.tokens, -1 - group)
                texts[-1] = f"{head.text}\n{made.text}"
                facts[-1] = {
                    **facts[-1],
                    "prefix_tokens": synthetic.prefix.tokens,
                    "prefix_group": group,
                    # The prefix and the prompt meet at a newline the tokenizer may merge: the
                    # template's share of usage is not known to the token here.
                    "template_tokens": None,
                }
        prompts = tuple(base.model_copy(update={"prompt": text}) for text in texts)
        digest = hashlib.sha256(
            "\n".join(prompt.sha256(request) for prompt in prompts).encode()
        ).hexdigest()
        sha = prompts[0].sha256(request) if len(prompts) == 1 else digest
        return LoadPrompts(prompts, request, sha, tuple(facts))
    if profile.trace is not None and prompt_id == profile.prompt_ids(())[0]:
        return _trace_prompts(live, profile.trace)
    if profile.dataset is not None and prompt_id == dataset_prompt_id(profile.dataset):
        items = sample_dataset(profile.dataset, f"{cell.cell_id}: load.dataset")
        prompts = tuple(dataset_prompt(prompt_id, None, item, profile.dataset) for item in items)
        request = cell.spec.request or RequestShape()
        return LoadPrompts(prompts, request, load_dataset_sha256(profile, request))
    prompt, request = load_prompt(matrix, cell, prompt_id)
    return LoadPrompts((prompt,), request, prompt.sha256(request))


def _trace_prompts(live: LiveCell, trace: Trace) -> LoadPrompts:
    """A trace's requests in arrival order, each its own prompt and output length (fixed:
    ignore_eos, as the trace's answer was that long)."""
    entries = read_trace(trace, f"{live.cell.cell_id}: load.trace")
    request = live.cell.spec.request or RequestShape()
    if request.ignore_eos is None:
        request = request.merged(RequestShape(ignore_eos=True))
    prompts = tuple(
        Prompt(intent=f"trace request {i}", prompt=text, max_tokens=entry.output_tokens)
        for i, (entry, text) in enumerate(
            zip(entries, trace_texts(live, trace, entries), strict=True)
        )
    )
    facts = tuple(
        SyntheticFields(
            input_tokens_requested=entry.input_tokens,
            trace_at_s=round(entry.at_s, 6),
            trace_hash_ids=len(entry.hash_ids),
        )
        for entry in entries
    )
    digest = hashlib.sha256("\n".join(p.sha256(request) for p in prompts).encode()).hexdigest()
    return LoadPrompts(prompts, request, digest, facts)


def session_plan(
    profile: LoadProfile, sends: LoadPrompts, engine: ChatPayloads
) -> SessionPlan | None:
    """`turns:`: the sessions' plan, its user turns the load case's prompts in turn."""
    if profile.turns is None:
        return None
    first = sends.prompts[0]
    body = engine.payload(Request(first.prompt, first.max_tokens, sends.request))
    body.pop("messages", None)
    user_turns = tuple(
        tuple((turn["role"], turn["content"]) for turn in prompt.chat_messages() or [])
        if prompt.messages is not None
        else (("user", prompt.prompt),)
        for prompt in sends.prompts
    )
    return SessionPlan(profile.turns, profile.think_time_s, json.dumps(body).encode(), user_turns)


def session_figures(calls: list[dict[str, Any]], turns: int | None) -> LoadFigures:
    """A multi-turn point's sessions as units: how many ran whole, per-turn TTFT and prompt
    tokens (p50 of each turn), and the session's span from its first send to its last byte."""
    if turns is None:
        return {}
    sessions: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for call in calls:
        if call.get("load_window") == "measured" and call.get("session_idx") is not None:
            sessions.setdefault((call["process"] or 0, call["session_idx"]), []).append(call)
    whole = [s for s in sessions.values() if len(s) == turns and all(c["error"] is None for c in s)]
    spans = [
        max(c["send_ms"] + (c["total_duration_ms"] or 0.0) for c in s)
        - min(c["send_ms"] for c in s)
        for s in whole
    ]
    by_turn = [[c for s in whole for c in s if c["turn"] == t] for t in range(turns)]
    return {
        "turns": turns,
        "sessions": len(sessions),
        "sessions_ok": len(whole),
        "ttft_ms_p50_by_turn": [
            percentile([c["first_delta_ms"] for c in group], 50) for group in by_turn
        ],
        "prompt_tokens_p50_by_turn": [
            percentile([float(c["prompt_tokens"] or 0) for c in group], 50) for group in by_turn
        ],
        "session_ms_p50": percentile(spans, 50),
        "session_ms_p99": percentile(spans, 99),
    }


def run_load_case(
    live: LiveCell, matrix: Matrix, case: Case, run_id: str, pressure: CpuPressure | None = None
) -> LoadOutcome:
    """Warm the engine up with the case's request, then run its load point, with Python's
    cyclic garbage collector held off: a full collection in a pytest process takes milliseconds,
    and a send due then would go out that late (the client's allocations are freed by reference
    counting all the same). No collection before it either: in a process that has run many
    sessions one took half a second, and what is frozen is collected after the point."""
    gc.freeze()
    gc.disable()
    try:
        return _run_load_case(live, matrix, case, run_id, pressure)
    finally:
        gc.enable()
        gc.unfreeze()


def _run_load_case(
    live: LiveCell, matrix: Matrix, case: Case, run_id: str, pressure: CpuPressure | None
) -> LoadOutcome:
    cell = live.cell
    profile = cell.load
    assert profile is not None and case.load_point is not None and live.engine is not None
    sends = load_prompts(live, matrix, case.prompt_id)
    request = sends.request

    def chat(p: Prompt, shape: RequestShape = request) -> Request:
        """A load point's chat request of `p`: its turns where it has some."""
        turns = p.chat_messages() if p.messages is not None else None
        return Request(p.prompt, p.max_tokens, shape, turns)

    # The warm-up sends the last of the prompts taken in turn: a point that sends each once
    # (unique prompts) then finds none of them cached by the warm-up. What the warm-ups sent,
    # held by no call record: the load record counts them, so that the engine's own request
    # count adds up to the ledger's.
    warmups = int(live.warm_up(chat(sends.prompts[-1])))
    for adapter in cell.adapters:
        # Each adapter's first request may load it: warmed up before the point, not in it.
        adapted = cell.adapter_request(request, adapter)
        warmups += live.warm_up(chat(sends.prompts[-1], adapted), adapter)
    engine = live.engine
    # Only such engines' cells take a load profile (config/cell_rules.check_load).
    assert isinstance(engine, ChatPayloads)
    payloads = [json.dumps(engine.payload(chat(p))).encode() for p in sends.prompts]
    # A cell that chooses LoRA adapters per request: each adapter's requests, and the choice.
    adapters = (
        AdapterChoice(
            cell.adapters,
            profile.lora_choice,
            profile.seed,
            profile.lora_weights,
            # A trace's requests are sent as recorded: request i is its entry i.
            in_order=profile.trace is not None and case.prompt_id == profile.prompt_ids(())[0],
        )
        if cell.adapters
        else None
    )
    adapter_payloads = tuple(
        tuple(
            json.dumps(merge_body(json.loads(payload), cell.adapter_body(name))).encode()
            for payload in payloads
        )
        for name in cell.adapters
    )
    target = build_target(
        engine.kind,
        engine.base_url,
        payloads[0],
        engine.request_headers(),
        cell.timeout_s,
        engine.tls,
        tuple(payloads[1:]),
        session_plan(profile, sends, engine),
        adapters,
        adapter_payloads,
    )
    recorder = _Recorder(run_id, cell, case, sends.sha256, profile, pressure)
    recorder.adapters = adapters
    if profile.clients is not None:
        recorder.client_nodes = matrix.nodes
    recorder.facts = sends.facts
    if case.load_point == "sweep":
        started = utc_now()
        sweep = asyncio.run(
            run_sweep(
                profile,
                lambda point, pattern, step: recorder.step(target, point, pattern, step),
            )
        )
        steps = [record for record in recorder.loads]
        valid = [step for step in steps if step["valid"]]
        record = load_record(
            run_id=run_id,
            cell=cell,
            case=case,
            prompt_sha256=recorder.sha256,
            load_point="sweep",
            pattern={"pattern": "sweep", **sweep},
            started_at_utc=started,
            summary={
                "output_tokens": sum(step.get("output_tokens") or 0 for step in steps),
                "load_settings": profile.shaping(
                    open_loop=True, sweep=True, adapters=adapters is not None
                ),
            },
            error=None if valid else "no step of the sweep was a valid result",
        )
        record["unrecorded_warmups"] = warmups
        live.last_call_end = time.monotonic()
        return LoadOutcome(as_json(record), recorder.records)
    pattern = make_pattern(profile, case.load_point)
    asyncio.run(recorder.step(target, case.load_point, pattern))
    live.last_call_end = time.monotonic()
    main = recorder.records.pop()
    main["unrecorded_warmups"] = warmups
    return LoadOutcome(main, recorder.records)


class _Recorder:
    """Runs steps and turns what each sent into records."""

    def __init__(
        self,
        run_id: str,
        cell: Cell,
        case: Case,
        sha256: str,
        profile: LoadProfile,
        pressure: CpuPressure | None = None,
    ) -> None:
        self.run_id, self.cell, self.case, self.sha256 = run_id, cell, case, sha256
        self.profile = profile
        # The CPU pressure over each point (None: steadiness not checked).
        self.pressure = pressure
        self.records: list[dict[str, Any]] = []
        self.loads: list[dict[str, Any]] = []
        # Per prompt sent in turn: what its call records carry (request i: i mod n).
        self.facts: tuple[SyntheticFields, ...] = ()
        # `clients:`: cells.yaml's nodes, among them the one its client tasks run on.
        self.client_nodes: Any = None
        # A cell that chooses LoRA adapters per request: each request's (by its index).
        self.adapters: AdapterChoice | None = None

    async def step(
        self, target: Target, point: str, pattern: LoadPattern, sweep_step: str | None = None
    ) -> Mapping[str, Any]:
        run = LoadRun(target, self.profile, ramp_s=ramp_seconds(pattern))
        started = utc_now()
        wall_ns = time.time_ns() - time.perf_counter_ns()
        scraper = GaugeScraper(
            target.endpoint, target.headers, self.cell.telemetry.interval_ms, target.context
        )
        before = await scraper.scrape()
        pressure_mark = self.pressure.start() if self.pressure is not None else None
        stop = asyncio.Event()
        scraping: asyncio.Task[None] | None = None
        if before is not None:
            scraper.samples.counters_before = before[1]
        lost: list[str] = []
        offsets: dict[str, Any] = {}
        try:
            if self.profile.clients is not None or self.profile.processes > 1:
                started_ns = time.perf_counter_ns()
                scraping = asyncio.create_task(scraper.run(started_ns, stop)) if before else None
                started_ns, sent, lost, offsets = await asyncio.to_thread(
                    self._elsewhere, target, pattern
                )
            else:
                await run.open(pattern.connections)
                started_ns = run.started_ns
                if before is not None:
                    scraping = asyncio.create_task(scraper.run(started_ns, stop))
                await pattern.drive(run)
                sent = run.sent
        finally:
            stop.set()
            if scraping is not None:
                await scraping
            await run.close()
        cpu_pressure = self.pressure.share(pressure_mark) if self.pressure is not None else None
        after = await scraper.settled_counters() if before is not None else None
        if after is not None:
            scraper.samples.counters_after = after
        calls = [self._call(point, started_ns, wall_ns, item) for item in sent]
        summary = summarize_point(
            calls,
            offered_rate=pattern.offered_rate,
            slo=self.profile.slo,
            max_send_lag_ms=(
                self.profile.max_send_lag_ms if pattern.offered_rate is not None else None
            ),
            server=scraper.samples.server_changes() or None,
            slice_s=self.profile.slice_s,
            client_names=self._client_names(),
        )
        if lost:
            summary = lost_client_summary(summary, lost)
        facts = pattern.facts()
        record = load_record(
            run_id=self.run_id,
            cell=self.cell,
            case=self.case,
            prompt_sha256=self.sha256,
            load_point=point,
            pattern=facts,
            started_at_utc=started,
            summary={
                **summary,
                **({"sweep_step": sweep_step} if sweep_step is not None else {}),
                "load_settings": self.profile.shaping(
                    open_loop=facts["pattern"] == "open",
                    sweep=sweep_step is not None,
                    adapters=self.adapters is not None,
                ),
                "processes": self.profile.processes,
                "send_lag_by_process": lag_by_client(calls)
                if self.profile.processes > 1 or self.profile.clients is not None
                else None,
                **(
                    {"clients": self.profile.clients.model_dump(exclude_none=True), **offsets}
                    if self.profile.clients is not None
                    else {}
                ),
                # Every request of the point (warm-up and cool-down too) against the engine's
                # own counters over the same span (None where it exposes none).
                "client_completion_tokens": sum(
                    int(call.get("completion_tokens") or 0) for call in calls
                ),
                # The requests whose engine counted other tokens than it streamed (issue 35).
                "token_mismatches": sum(call.get("token_mismatch") is True for call in calls),
                "engine_counters": scraper.samples.counter_changes() or None,
                "engine_metrics_notes": scraper.samples.notes or None,
                **prefix_cache_figures(calls, scraper.samples.counter_changes()),
                **spec_decode_figures(scraper.samples.engine_counters()),
                **session_figures(calls, self.profile.turns),
                # Per LoRA adapter: its requests and latency percentiles (absent without).
                **(
                    {"lora_split": adapter_split(calls, self.adapters.names)}
                    if self.adapters is not None
                    else {}
                ),
                # The share of the point's time in which some task on this machine waited for
                # a CPU (our own client's and engine's tasks among them): how steady it was.
                **({"cpu_pressure": round(cpu_pressure, 4)} if cpu_pressure is not None else {}),
            },
            error=summary["invalid_reason"],
        )
        self.records.extend(calls)
        if scraper.samples.columns:
            self.records.append(
                as_json(
                    sample_record(
                        run_id=self.run_id,
                        cell=self.cell,
                        case=self.case,
                        interval_ms=scraper.samples.interval_ms,
                        gpu_source=None,
                        cpu_source=None,
                        columns={},
                        notes=scraper.samples.notes,
                        engine=scraper.samples.columns,
                        load_point=point,
                    )
                )
            )
        self.records.append(as_json(record))
        self.loads.append(as_json(record))
        return summary

    def _client_names(self) -> dict[int, str] | None:
        """Each client's name in a reason (None: one client, the pytest process)."""
        if self.profile.clients is None and self.profile.processes <= 1:
            return None
        return Clients.of(self.profile).names()

    def _elsewhere(
        self, target: Target, pattern: LoadPattern
    ) -> tuple[int, list[Sent], list[str], dict[str, Any]]:
        """The point sent by client processes here (`processes:`) or tasks on a Slurm or ssh
        node (`clients:`): (their shared start, their requests, the ones lost, the tasks' clock
        offsets)."""
        clients = self.profile.clients
        if clients is None:
            launch = launch_here()
        else:
            launch = launch_clients(clients.node, self.client_nodes[clients.node], clients.python)
        result = run_clients(target, self.profile, pattern, launch)
        if clients is None:
            return result.started_ns, result.sent, result.lost, {}
        offsets = {
            "client_offsets_ms": result.offsets_ms,
            "client_offset_errors_ms": result.offset_errors_ms,
        }
        return result.started_ns, result.sent, result.lost, offsets

    def _call(self, point: str, started_ns: int, wall_ns: int, sent: Sent) -> dict[str, Any]:
        at = datetime.fromtimestamp((wall_ns + sent.sent_ns) / 1e9, UTC)
        call = call_record(
            run_id=self.run_id,
            cell=self.cell,
            case=self.case,
            prompt_sha256=self.sha256,
            cold_kind=None,
            started_at_utc=at.isoformat(timespec="microseconds").replace("+00:00", "Z"),
            measurement=sent.measurement,
            adapter=self.adapters.name_of(sent.index) if self.adapters is not None else None,
        )
        # A workload's own facts (the prompt's tokens, its session and turn) are open fields.
        fields = cast(dict[str, Any], call)
        if self.facts:
            turn = (
                self.adapters.prompt_of(sent.index, len(self.facts))
                if self.adapters is not None
                else sent.index % len(self.facts)
            )
            fields.update(self.facts[turn])
        if sent.session is not None:
            fields.update(session_idx=sent.session, turn=sent.turn)
        return as_json(
            load_call_record(
                call,
                load_point=point,
                window=sent.window,
                request_idx=sent.index,
                scheduled_send_ms=round((sent.scheduled_ns - started_ns) / 1e6, 4),
                send_ms=round((sent.sent_ns - started_ns) / 1e6, 4),
                send_lag_ms=sent.send_lag_ms,
                process=(
                    sent.process
                    if self.profile.processes > 1 or self.profile.clients is not None
                    else None
                ),
            )
        )


def prefix_cache_figures(calls: list[dict[str, Any]], counters: Mapping[str, float]) -> LoadFigures:
    """The engine's prefix cache over the point, beside its latency: the share of prompt tokens
    it found cached, from vLLM's own counters (prefix_cache_hits / queries over the point), else
    from llama.cpp's per-request `cache_n` against the prompt tokens (every request of the
    point, warm-up and cool-down too, as the counters count them)."""
    queries = counters.get(VLLM_PREFIX_QUERIES)
    hits = counters.get(VLLM_PREFIX_HITS)
    if queries and hits is not None:
        return {"prefix_cache_hit_rate": round(hits / queries, 4), "prefix_cache_source": "vllm"}
    cached = [
        c for c in calls if c.get("cached_prompt_tokens") is not None and c.get("prompt_tokens")
    ]
    if cached:
        found = sum(int(c["cached_prompt_tokens"]) for c in cached)
        prompt = sum(int(c["prompt_tokens"]) for c in cached)
        return {"prefix_cache_hit_rate": round(found / prompt, 4), "prefix_cache_source": "cache_n"}
    return {"prefix_cache_hit_rate": None, "prefix_cache_source": None}


def spec_decode_figures(counters: Mapping[str, float]) -> LoadFigures:
    """Speculative decoding over the point from the engine's own counters (config/metrics.
    ENGINE_COUNTERS over the point: vLLM's or llama.cpp's spec_decode_*): the share of draft
    tokens accepted, and the mean acceptance length, the tokens each draft step yields
    (accepted per draft, plus the target model's own one, as vLLM counts it); None where the
    engine drafted nothing."""
    found = draft_counts(counters)
    drafts = found[2] if found is not None else None
    if found is None or not drafts:
        return {"spec_acceptance_rate": None, "spec_mean_acceptance_length": None}
    accepted, proposed, _ = found
    return {
        "spec_acceptance_rate": round(accepted / proposed, 4),
        "spec_mean_acceptance_length": round(accepted / drafts + 1, 4),
    }

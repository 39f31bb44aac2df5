"""The generated part of docs/policy.md: every key of the policy file with its type, default and meaning.

Types, bounds, defaults and which keys are required come from the JSON Schema that msgspec derives from
:class:`policies.schema.Policy` (the one ``specgate policy schema`` prints), so they cannot drift from the
code; the one-line meanings live in ``MEANINGS`` below, and a test fails when a key has none or when the page
is stale. ``render()`` is pure; ``python -m policies.reference`` rewrites the page's marked block
(``--check`` only compares).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import msgspec

from policies.schema import DRAFT_PARAMS, PROPOSER_KINDS, Policy

BEGIN = "<!-- generated: policy reference -->"
END = "<!-- end generated -->"
PAGE = Path(__file__).resolve().parents[1] / "docs" / "policy.md"

# Sections whose YAML path does not make a heading (used in many places, or the file itself).
TITLES = {"Policy": "Top level", "Range": "Number comparisons", "FractionRange": "Score comparisons"}

# One line per key, as "Struct.key". Inherited keys are listed once, under the Struct that declares them.
MEANINGS = {
    "Policy.version": "schema version",
    "Policy.slo": "default SLO; a route's `slo` overrides it field by field",
    "Policy.routes": "applications (API keys); empty: auth off, every request is route `default`",
    "Policy.slices": "first match wins; the last has no `when` (the default slice)",
    "Policy.pools": "worker pools, one speculative configuration each",
    "Policy.pairs": "target-draft pairs; each is one versioned artifact",
    "Policy.rules": "first match decides; no match: serve without speculation",
    "Policy.learning": "statistics and `auto` settings",
    "Policy.resume": "resuming an answer on another worker when its worker fails mid-answer",
    "Policy.tracing": "record served requests as a replay trace; none: off (unless `serve --trace`)",
    "Policy.gates": "the rollout gates and the collapse watch; none: no gate runs ([Pair gates](#pair-gates))",
    "Policy.state": "fleet state shared through Valkey/Redis; none: each gateway keeps its own (`serve --state`)",
    "State.url": "`valkey://`, `redis://` or `rediss://` (TLS) `host:port/db`; no password in it",
    "State.key_prefix": "prefix of every key, so two fleets can share one server",
    "State.password_env": "environment variable holding the server's password",
    "State.password_file": "file holding the server's password (relative to the policy's folder)",
    "State.sync_interval_s": "how often a replica flushes its evidence and reads the fleet's",
    "State.timeout_ms": "longest wait for one server call before the replica runs on its local state",
    "Slo.ttft_ms": "time to first token target, ms",
    "Slo.tpot_ms": "time per output token target, ms",
    "Route.name": "the route's name (in metrics, logs and conditions)",
    "Route.api_keys_env": "environment variable holding comma-separated API keys",
    "Route.api_keys_file": "file with one API key per line",
    "Route.slo": "this route's SLO, over the top-level one",
    "Route.slo_override": "whether and how tightly clients may set their own SLO per request (x-slo-* headers)",
    "SloOverride.allow": "accept the x-slo-ttft-ms / x-slo-tpot-ms headers (false: 400)",
    "SloOverride.min_ttft_ms": "the tightest x-slo-ttft-ms accepted (lower: 400)",
    "SloOverride.min_tpot_ms": "the tightest x-slo-tpot-ms accepted (lower: 400)",
    "Route.rate_limit": "admission limits of the route",
    "Route.max_concurrency": "requests of the route in flight at once (across the fleet with `state`)",
    "RateLimit.requests_per_s": "sustained requests per second",
    "RateLimit.tokens_per_min": "tokens per minute: approximate prompt + `max_tokens`",
    "RateLimit.burst": "the request bucket's capacity; none: the rate, rounded up",
    "Slice.name": "the slice's name; may repeat (two entries, one slice)",
    "Slice.when": "conditions, all must hold; none: the default slice",
    "SliceWhen.route": "the request's route (a list: any of them)",
    "SliceWhen.model": "the requested model",
    "SliceWhen.has_tools": "the request has `tools`",
    "SliceWhen.response_format": "the request's `response_format` type (`none`: not given)",
    "SliceWhen.prompt_tokens": "approximate prompt tokens: ceil(UTF-8 bytes / 3.6)",
    "SliceWhen.max_tokens": "the request's `max_tokens`",
    "SliceWhen.temperature": "the request's temperature",
    "SliceWhen.stream": "the request streams",
    "SliceWhen.code_score": "0..1, how much the prompt is about code",
    "SliceWhen.prompt_repeat": "0..1, share of the prompt's word 4-grams seen earlier in it",
    "SliceWhen.slo_ttft_ms": "the request's TTFT SLO in ms: its x-slo-ttft-ms header, else its route's",
    "SliceWhen.slo_tpot_ms": "the request's TPOT SLO in ms: its x-slo-tpot-ms header, else its route's",
    "SliceWhen.headers": "request header values by name (case-insensitive)",
    "Range.gt": "greater than", "Range.gte": "at least", "Range.lt": "less than", "Range.lte": "at most",
    "Range.eq": "equal to",
    "FractionRange.gt": "greater than", "FractionRange.gte": "at least", "FractionRange.lt": "less than",
    "FractionRange.lte": "at most", "FractionRange.eq": "equal to",
    "Pool.proposer": "the draft method; must fit the pair's draft kind",
    "Pool.draft_tokens": "draft length k, or `{min, max}` (per_request only); none for `proposer: none`",
    "Pool.pair": "the pair it serves; required unless `proposer: none`",
    "Pool.workers": "the workers' URLs",
    "Pool.speculation": "`server`: SGLang launched with it, k fixed; `per_request`: the embedded worker",
    "Pool.adaptive": "the worker picks k 0..`draft_tokens` per round and sequence (per_request)",
    "Pool.strategy": "with `adaptive`: the per-round controller (specgate's, SGLang's, vLLM's)",
    "Pool.k_by_batch": "with `strategy: vllm`: k by batch-size range, e.g. `{\"1-3\": 8, \"4-15\": 4}`",
    "DraftRange.min": "smallest k `auto` may choose",
    "DraftRange.max": "largest k `auto` may choose",
    "Pair.target": "the target model's identity",
    "Pair.draft": "the draft's identity and settings",
    "ModelId.model": "model name or path, as the workers report it",
    "ModelId.revision": "weights revision (a commit or `sha256:`)",
    "ModelId.weight_version": "the workers' `--weight-version`",
    "DraftId.kind": "the draft algorithm",
    "DraftId.model": "draft weights (`model`, `eagle`, `eagle3`)",
    "DraftId.revision": "draft weights revision",
    "DraftId.weight_version": "draft weights version",
    "DraftId.layers": "`layer_truncated`: the target's first N layers",
    "DraftId.params": "settings that change acceptance (n-gram window, suffix tree bounds, EAGLE top-k)",
    "Rule.name": "the rule's name (in decisions, metrics and logs)",
    "Rule.when": "conditions, all must hold; none: a catch-all, which must come last",
    "Rule.then": "`bypass`, `auto`, or a pool action",
    "RuleWhen.slice": "the request's slice",
    "RuleWhen.budget_tokens": "generation budget left",
    "RuleWhen.concurrency": "the load a decision sees (requests in flight, or the busiest pool's per worker)",
    "RuleWhen.pool": "the subject pool of the `pool.*`, `pair_*` and `stats.*` conditions",
    "RuleWhen.pool.healthy": "the subject pool is healthy",
    "RuleWhen.pool.kv_usage": "the subject pool's KV cache usage, 0..1",
    "RuleWhen.pool.running": "requests running on the subject pool",
    "RuleWhen.pool.waiting": "requests queued on the subject pool",
    "RuleWhen.pool.workers_healthy": "healthy workers of the subject pool",
    "RuleWhen.pair_verified": "`false`: the pool's pair is mismatched or not yet probed",
    "RuleWhen.pair_gate": "the subject pool's gate state; needs `gates:`",
    "RuleWhen.stats.mean_accept_length": "learned accept length of (route, slice, pool, pair version)",
    "RuleWhen.stats.rounds": "learned verification rounds, decayed",
    "RuleWhen.stats.requests": "learned requests, decayed",
    "PoolAction.pool": "serve on this pool",
    "PoolAction.pools": "`auto` among these pools (and plain)",
    "PoolAction.draft_tokens": "a fixed k in the pool's range, or `auto`",
    "Learning.half_life_s": "statistics lose half their weight every half-life",
    "Learning.min_rounds": "decayed rounds a route's own acceptance needs before `stats.*` read it",
    "Learning.min_gain": "a speculative option must beat plain's posterior draw by this factor",
    "Learning.concurrency_buckets": "load bucket edges: a context of `auto`, the dashboards' load axis",
    "Learning.repeat_bands": "`prompt_repeat` band edges: a context of `auto` (`[]`: one band)",
    "Learning.counterfactual": "every greedy answer also teaches `auto` the cost of each fixed-k n-gram or suffix "
                               "option of its rule (full information; `false`: only the option it was served with)",
    "Learning.slo_objective": "which TPOT SLO steers `auto` to the cheapest of the options likeliest to meet it: "
                              "`stated` (only an `x-slo-tpot-ms` header), `in_force` (the route's too), `none`",
    "Resume.max_resumes": "resumes per request after a worker failed mid-answer; 0: never (an error event ends it)",
    "Resume.deadline_s": "no resume starts once the request has run this long",
    "Resume.fallback": "a resume may go to the plain fallback pool when the served pool has no other healthy worker",
    "Resume.whole_answers": "a whole (non-streamed) answer that may resume is streamed from its worker and assembled "
                            "here, so it resumes too (`false`: served again from token 0 on a worker failure)",
    "Tracing.path": "the trace file, relative to the policy's folder (which must exist)",
    "Tracing.max_bytes": "rotate before a line would pass this size (64 MiB)",
    "Tracing.keep": "rotated files kept: `path.1` (newest) .. `path.{keep}`",
    "Tracing.sample": "share of requests recorded, by sha256(\"seed:request id\")",
    "Tracing.seed": "changes which requests `sample` picks",
    "Tracing.routes": "record only these routes; none: all",
    "Tracing.costs": "cost model file (`specgate trace calibrate`) for `POST /admin/replay`; none: a worker's live costs",
    "Gates.equivalence": "canaries token-identical to plain, and the sampled check (always on)",
    "Gates.serving": "the serving ramp per load region; null: off",
    "Gates.outcome": "the outcome gate on reported task success; null: off",
    "Gates.collapse": "the acceptance collapse detector; null: off",
    "Equivalence.canaries": "JSON Lines canary file, relative to the policy; none: the built-in four",
    "Equivalence.per_slice": "canaries run per slice",
    "Equivalence.max_canaries": "canaries run in all, at most",
    "Equivalence.max_tokens": "greedy output tokens per canary",
    "Equivalence.timeout_s": "budget of one run; past it the run is an error, retried",
    "Equivalence.retry_s": "an error run is retried after this",
    "Equivalence.concurrency": "canary requests in flight at once",
    "Equivalence.sampled": "the sampled distribution check; null: greedy identity only",
    "SampledCheck.samples": "sampled completions per side and prompt",
    "SampledCheck.max_tokens": "tokens per sampled completion",
    "SampledCheck.temperature": "sampling temperature",
    "SampledCheck.prompts": "canaries the check runs on",
    "SampledCheck.alpha": "test level (Bonferroni over positions)",
    "SampledCheck.seed": "first seed of the speculative side",
    "Serving.initial_share": "a load region's first share of the pool's requests",
    "Serving.growth": "share factor per good window",
    "Serving.window": "requests per side per window",
    "Serving.max_tpot_ratio": "pool's p50 TPOT over plain's, at most",
    "Serving.max_ttft_ratio": "pool's p50 TTFT over plain's, at most",
    "Serving.min_slo_ratio": "pool's SLO attainment over plain's, at least",
    "Serving.retry_s": "how long a missed region stays closed",
    "OutcomeCheck.min_reports": "reports per side before the test runs",
    "OutcomeCheck.alpha": "the one-sided test's level",
    "OutcomeCheck.max_drop": "non-inferiority margin, in success rate",
    "OutcomeCheck.ttl_s": "how long after it finished a request takes a report",
    "OutcomeCheck.max_tracked": "finished requests remembered for reports",
    "Collapse.window_rounds": "verification rounds per window",
    "Collapse.floor": "accept length below which a window with a good baseline collapsed",
    "Collapse.min_baseline": "the baseline from which the floor applies",
    "Collapse.shift_alpha": "level of the histogram shift test; null: the floor only",
    "Collapse.recheck_s": "a degraded pool idle this long runs its equivalence gate again",
}


def schema() -> dict[str, Any]:
    """The policy file's JSON Schema, as ``specgate policy schema`` prints it."""
    return msgspec.json.schema(Policy)


def _ref(node: dict[str, Any]) -> str | None:
    return node["$ref"].rsplit("/", 1)[1] if "$ref" in node else None


def _children(node: dict[str, Any], suffix: str = "") -> list[tuple[str, str]]:
    """(struct, path suffix) for every struct a property's schema refers to."""
    if (name := _ref(node)) is not None:
        return [(name, suffix)]
    found = []
    for option in node.get("anyOf", []):
        found += _children(option, suffix)
    if node.get("type") == "array" and "items" in node:
        found += _children(node["items"], suffix + "[]")
    if isinstance(node.get("additionalProperties"), dict):
        found += _children(node["additionalProperties"], suffix + ".*")
    return found


def _walk(defs: dict[str, Any]) -> dict[str, list[str]]:
    """Struct name -> the YAML paths it appears at; structs in the file's order (depth first)."""
    paths: dict[str, list[str]] = {}

    def visit(struct: str, path: str) -> None:
        seen = struct in paths
        paths.setdefault(struct, [])
        if path not in paths[struct]:
            paths[struct].append(path)
        for key, node in defs[struct].get("properties", {}).items():
            for child, suffix in _children(node):
                if not seen or child not in paths:
                    visit(child, f"{path}.{key}{suffix}".lstrip("."))
                elif (more := f"{path}.{key}{suffix}".lstrip(".")) not in paths[child]:
                    paths[child].append(more)

    visit("Policy", "")
    return paths


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.lower()).replace(" ", "-")


def _heading(struct: str, paths: list[str]) -> str:
    return TITLES.get(struct) or f"`{paths[0]}`"


def _also(struct: str, paths: list[str]) -> str:
    """Where else a section's keys are written (nothing for a section at one place, its heading)."""
    if struct not in TITLES:
        return "Also at " + ", ".join(f"`{p}`" for p in paths[1:]) + "." if len(paths) > 1 else ""
    if not all(".when." in p for p in paths):
        return "The value of " + ", ".join(f"`{p}`" for p in paths if p) + "." if any(paths) else ""
    keys = dict.fromkeys(p.split(".when.", 1)[1] for p in paths)
    return "The value of these `when` keys: " + ", ".join(f"`{k}`" for k in keys) + "."


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else repr(value)


def _bounds(node: dict[str, Any]) -> str:
    lo = (">=", node["minimum"]) if "minimum" in node else (">", node["exclusiveMinimum"]) \
        if "exclusiveMinimum" in node else None
    hi = ("<=", node["maximum"]) if "maximum" in node else ("<", node["exclusiveMaximum"]) \
        if "exclusiveMaximum" in node else None
    if lo and hi and lo[0] == ">=" and hi[0] == "<=":
        return f" {_number(lo[1])}..{_number(hi[1])}"
    if lo and hi:
        return f" {lo[0]} {_number(lo[1])}, {hi[0]} {_number(hi[1])}"
    if lo or hi:
        op, value = lo or hi  # type: ignore[misc]
        return f" {op} {_number(value)}"
    return ""


def type_of(node: dict[str, Any], anchors: dict[str, str]) -> str:
    """A schema node in a few words (``null`` is left out: the default column says when none is allowed)."""
    if (name := _ref(node)) is not None:
        return f"[{name}](#{anchors[name]})"
    if "anyOf" in node:
        options = [n for n in node["anyOf"] if n.get("type") != "null"]
        if len(options) == 2 and options[1] == {"type": "array", "items": options[0]}:
            return f"{type_of(options[0], anchors)}, or a list of them"
        return " or ".join(type_of(n, anchors) for n in options)
    if "enum" in node:
        return ", ".join(f"`{json.dumps(v).strip(chr(34))}`" for v in node["enum"])
    kind = node.get("type")
    if kind == "integer":
        return "int" + _bounds(node)
    if kind == "number":
        return "number" + _bounds(node)
    if kind == "boolean":
        return "bool"
    if kind == "string":
        if "description" in node:
            return "name" if node["description"].startswith("letters") else "URL"
        return "env var name" if "pattern" in node else "string"
    if kind == "array":
        least = f" (>= {node['minItems']})" if "minItems" in node else ""
        return f"list{least} of {type_of(node['items'], anchors)}"
    if kind == "object":
        key = "name" if "propertyNames" in node else "string"
        least = f" (>= {node['minProperties']})" if "minProperties" in node else ""
        return f"map{least}: {key} -> {type_of(node['additionalProperties'], anchors)}"
    raise ValueError(f"policies.reference: no rendering for schema node {node}")


def default_of(node: dict[str, Any], required: bool, implied: Any) -> str:
    """The default column: ``required``, ``none`` (absent), a value, or ``its defaults`` (a section's own)."""
    if required:
        return "required"
    value = node.get("default", implied)
    if value is None:
        return "none"
    if isinstance(value, dict) and value and (_ref(node) or any(_ref(n) for n in node.get("anyOf", []))):
        return "its defaults"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (int, float)):
        return f"`{_number(value)}`"
    if isinstance(value, list):
        return "`[" + ", ".join(_number(v) if isinstance(v, (int, float)) else str(v) for v in value) + "]`"
    return f"`{json.dumps(value).strip(chr(34))}`"


def _implied_defaults(defs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Struct -> its fields' defaults as a referring property's default shows them (msgspec leaves a
    ``default_factory`` field's default out of the field itself)."""
    found: dict[str, dict[str, Any]] = {}
    for struct in defs.values():
        for node in struct.get("properties", {}).values():
            for child, _ in _children(node):
                if isinstance(node.get("default"), dict):
                    found.setdefault(child, node["default"])
    return found


def _inherits(struct: str, defs: dict[str, Any], done: list[str]) -> str | None:
    """An earlier section whose keys this struct repeats unchanged (RuleWhen repeats SliceWhen's)."""
    props = defs[struct].get("properties", {})
    for earlier in done:
        theirs = defs[earlier].get("properties", {})
        if len(theirs) >= 3 and len(theirs) < len(props) and all(props.get(k) == v for k, v in theirs.items()):
            return earlier
    return None


def _sections(defs: dict[str, Any]) -> list[tuple[str, list[str], str | None, list[str]]]:
    """(struct, its YAML paths, the earlier section it extends or None, the keys it shows) in page order."""
    done: list[str] = []
    sections = []
    for struct, where in _walk(defs).items():
        parent = _inherits(struct, defs, done)
        skip = set(defs[parent]["properties"]) if parent else set()
        sections.append((struct, where, parent, [k for k in defs[struct].get("properties", {}) if k not in skip]))
        done.append(struct)
    return sections


def rows() -> list[str]:
    """"Struct.key" for every row the reference shows: what ``MEANINGS`` must cover."""
    return [f"{struct}.{key}" for struct, _, _, keys in _sections(schema()["$defs"]) for key in keys]


def render() -> str:
    """The generated block, markers included."""
    defs = schema()["$defs"]
    sections = _sections(defs)
    headings = {struct: _heading(struct, where) for struct, where, _, _ in sections}
    anchors = {struct: slug(heading) for struct, heading in headings.items()}
    implied = _implied_defaults(defs)
    out = [BEGIN, "<!-- python -m policies.reference regenerates this part from policies/schema.py: "
                  "edit the code, not this text -->", ""]
    for struct, where, parent, keys in sections:
        out.append(f"### {headings[struct]}")
        if also := _also(struct, where):
            out += [also, ""]
        if parent is not None:
            out += [f"Every key of [{headings[parent]}](#{anchors[parent]}), and:", ""]
        required = set(defs[struct].get("required", []))
        out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for key in keys:
            node = defs[struct]["properties"][key]
            default = default_of(node, key in required, implied.get(struct, {}).get(key))
            out.append(f"| `{key}` | {type_of(node, anchors)} | {default} | {MEANINGS.get(f'{struct}.{key}', '')} |")
        out.append("")
    out += _proposers()
    out.append(END)
    return "\n".join(out)


def _proposers() -> list[str]:
    """Which draft kinds each proposer runs, and the ``params`` a kind accepts (checked at load)."""
    lines = ["### Proposers and draft kinds", "| `pools.*.proposer` | `pairs.*.draft.kind` | `params` checked |",
             "|---|---|---|"]
    for proposer, kinds in PROPOSER_KINDS.items():
        checked = sorted({key for kind in kinds for key in DRAFT_PARAMS.get(kind, {})})
        lines.append(f"| `{proposer}` | {', '.join(f'`{k}`' for k in kinds)} | "
                     f"{', '.join(f'`{k}`' for k in checked) or 'free-form'} |")
    return lines + ["", "`none` takes no pair. Kind `layer_truncated` needs `layers`; `model`, `eagle` and `eagle3` "
                        "need `model`.", ""]


def splice(page: str, block: str) -> str:
    """The page with its marked block replaced by ``block``."""
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the page has no {BEGIN} ... {END} block")
    return page[:start] + block + page[end + len(END):]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m policies.reference",
                                     description="Regenerate the key reference in docs/policy.md from the schema.")
    parser.add_argument("--page", type=Path, default=PAGE, help="the page to update (default: docs/policy.md)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when the page is stale")
    args = parser.parse_args(argv)
    page = args.page.read_text(encoding="utf-8")
    fresh = splice(page, render())
    if args.check:
        if fresh != page:
            print(f"{args.page}: the policy reference is stale; run python -m policies.reference", file=sys.stderr)
            return 1
        return 0
    if fresh != page:
        args.page.write_text(fresh, encoding="utf-8")
        print(f"{args.page}: policy reference regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Request features the policy conditions look at, and the cheap estimators behind three of them.

The estimators run per request in the gateway, before any worker is called, so they must cost
microseconds and need no tokenizer; the two that read the text at length (``code_score``, ``prompt_repeat``)
run only when the policy reads them:

- :func:`approx_tokens` = ceil(UTF-8 bytes / 3.6): within 0.85-1.4x of SmolLM2's tokenizer on the
  workloads' slices, close enough for policy thresholds, which are coarse (hundreds of tokens).
- :func:`code_score` in [0, 1] mixes five signals of code in the first 8000 characters: a Markdown code
  fence (0.35), the share of indented lines (0.2), the share of lines ending in ``{ } ; : ) ,`` (0.15),
  programming keywords per line (0.15) and the density of brackets/operators (0.15); and adds 0.5 (capped
  at 1) when the request asks for code in words ("Write a C++ program...", "Implement a function...",
  "... in Python"), looked for in the first and last 1000 characters, where instructions sit. The weights
  put code prompts above 0.3 (and a request for code above 0.5) and prose or tool questions below 0.3,
  where the default policy splits.
- :func:`prompt_repeat` in [0, 1], a predictor of n-gram / prompt-lookup acceptance: on the last 8000
  characters, split into words and single punctuation marks (``\\w+|[^\\w\\s]``), the share of word 4-gram
  positions whose 4-gram occurred earlier in the sample ((positions - distinct 4-grams) / positions; 0.0 under
  5 words). It costs about what code_score does (tens of microseconds). It is a weak predictor on its own
  (rank correlation +0.29 with the ngram accept length of the prompts in docs/runs/full), so it is context
  for a learner rather than a threshold.

The measured figures behind these constants: docs/runs/2026-11-29-request-features/README.md.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Literal

import msgspec

BYTES_PER_TOKEN = 3.6
_SAMPLE_CHARS = 8000
_KEYWORDS = re.compile(
    r"\b(def|class|return|import|from|function|const|let|var|public|private|static|void|for|while|elif|"
    r"else|try|except|catch|struct|fn|impl|package|func|lambda|async|await|self|this|null|None|True|"
    r"False|println|printf|include|namespace|interface|extends|yield)\b")
_SYMBOLS = re.compile(r"[{}()\[\];=<>+*/%&|!]")
_INDENTED = re.compile(r"^(?:\t| {2,})\S", re.MULTILINE)
_CODE_END = re.compile(r"[{};:),]\s*$", re.MULTILINE)
# A request for code in words, matched on lowercased text: a verb asking for code, then within four words
# (none of them a preposition such as about, for, of: "an essay about the function of the kidneys") something that
# is code. Nouns that are also everyday words (a training program, a class schedule, a video script, a query letter)
# count after implement, debug, fix or refactor, or after a language ("a Python script"); the rest after any such verb.
# Or "in <language>", capitalised as languages are ("covered in rust" is not code). Literal alternations
# without a leading \b, which Python's re scans fast.
_ASK_VERB = re.compile(
    r"(?:(implement|debug|fix|refactor)|write|rewrite|complete|develop|create|build|generate|optimi[sz]e)\s+")
_GAP = (r"(?:(?:a|an|the|some|me|us|my|our|this|that|these)\s+)?"
        r"(?:(?!(?:about|on|of|for|to|with|regarding|describing|explaining|that|which)\b)[\w+#.-]+\s+){0,4}?")
_CODE_NOUN = (r"(?:functions?|code(?!\s+of\b)|websites?|web ?pages?|algorithms?|regex(?:es)?|regular expressions?|"
              r"snippets?|unit tests?|apis?|sql|shell commands?)")
_EVERYDAY_NOUN = r"(?:programs?|scripts?|class(?:es)?|methods?|quer(?:y|ies)|modules?)"
_LANGUAGE_WORD = (r"(?:python|c\+\+|c#|java|javascript|typescript|rust|go|golang|bash|shell|powershell|sql|html|css|"
                  r"ruby|php|kotlin|swift|scala|haskell|perl|r|matlab|computer)")
_ASK_ANY = re.compile(_GAP + "(?:" + _CODE_NOUN + "|" + _EVERYDAY_NOUN + r")\b")
_ASK_CODE = re.compile(_GAP + "(?:" + _CODE_NOUN + "|" + _LANGUAGE_WORD + r"\s+(?:[\w-]+\s+){0,2}?"
                       + _EVERYDAY_NOUN + r")\b")
_ASK_LANGUAGE = re.compile(
    r"in (?:Python|C\+\+|C#|Java|JavaScript|TypeScript|Rust|Golang|Ruby|PHP|Kotlin|Swift|SQL|Bash|HTML|CSS|"
    r"Scala|Haskell)\b")
_ASK_CHARS = 1000
_REPEAT_CHARS = 8000
_REPEAT_N = 4
_WORDS = re.compile(r"\w+|[^\w\s]")


class RequestFeatures(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the gateway knows about a request before dispatch. ``headers``: lowercase name -> value, only
    those the policy references (:func:`referenced_headers`). ``budget_tokens``: the generation budget
    left (defaults to max_tokens; the gateway may lower it for the context window or a rate limit)."""

    route: str = "default"
    model: str = ""
    has_tools: bool = False
    response_format: Literal["text", "json_object", "json_schema"] | None = None
    prompt_tokens: int = 0
    max_tokens: int | None = None
    temperature: float | None = None
    stream: bool = False
    headers: dict[str, str] = {}
    code_score: float | None = 0.0  # None: not computed (the gateway skips it when no condition it reaches reads it)
    prompt_repeat: float | None = 0.0  # None: not computed (the gateway computes it only for a policy that reads it)
    budget_tokens: int | None = None
    # the request's SLO in force: its x-slo-ttft-ms / x-slo-tpot-ms header, else its route's (None: no target)
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_tpot_stated: bool = False  # slo_tpot_ms is the request's own (its x-slo-tpot-ms header), not its route's

    @property
    def budget(self) -> int | None:
        return self.budget_tokens if self.budget_tokens is not None else self.max_tokens


def approx_tokens(text: str) -> int:
    """Token count estimate: ceil(UTF-8 bytes / 3.6) (see the module docstring for its error)."""
    return math.ceil(len(text.encode("utf-8")) / BYTES_PER_TOKEN)


def code_score(text: str) -> float:
    """How much ``text`` is about source code, 0..1: its look of code, plus a request for code in words
    (weights in the module docstring)."""
    sample = text[:_SAMPLE_CHARS]
    lines = [line for line in sample.splitlines() if line.strip()]
    if not lines:
        return 0.0
    n = len(lines)
    fence = 1.0 if "```" in sample else 0.0
    indented = min(1.0, 2.0 * len(_INDENTED.findall(sample)) / n)
    endings = min(1.0, 2.0 * len(_CODE_END.findall(sample)) / n)
    keywords = min(1.0, len(_KEYWORDS.findall(sample)) / n)
    symbols = min(1.0, 12.0 * len(_SYMBOLS.findall(sample)) / max(1, len(sample)))
    form = 0.35 * fence + 0.2 * indented + 0.15 * endings + 0.15 * keywords + 0.15 * symbols
    return round(min(1.0, form + (0.5 if asks_for_code(text) else 0.0)), 4)


def asks_for_code(text: str) -> bool:
    """Whether the first or last 1000 characters of ``text`` ask for code in words: a verb such as write,
    implement or fix followed within four words by function, code, API... (or program, script, class... after a
    language, or after implement, debug, fix, refactor); or "in <language>".
    A request for code written in prose has few of code's marks, yet its answer is code."""
    windows = (text,) if len(text) <= 2 * _ASK_CHARS else (text[:_ASK_CHARS], text[-_ASK_CHARS:])
    for window in windows:
        if _ASK_LANGUAGE.search(window):
            return True
        low = window.lower()
        for verb in _ASK_VERB.finditer(low):
            if verb.start() > 0 and low[verb.start() - 1].isalnum():
                continue
            if (_ASK_ANY if verb.group(1) else _ASK_CODE).match(low, verb.end()):
                return True
    return False


def prompt_repeat(text: str) -> float:
    """Share of the word 4-gram positions in the last 8000 characters of ``text`` whose 4-gram occurred
    earlier there, 0..1 (0.0 under 5 words; figures in the module docstring). Repeated positions = positions -
    distinct 4-grams, so the work is one regex pass and one ``set(zip(...))``, O(length)."""
    words = _WORDS.findall(text[-_REPEAT_CHARS:])
    positions = len(words) - _REPEAT_N + 1
    if positions < 2:
        return 0.0
    distinct = len(set(zip(*(words[i:] for i in range(_REPEAT_N)))))
    return round(1.0 - distinct / positions, 4)


def reads_prompt_repeat(policy: Any) -> bool:
    """Whether any slice or rule condition looks at ``prompt_repeat``, or an ``auto`` rule learns per band of
    it (``learning.repeat_bands`` not empty). Up to ~1 ms a long prompt, so the gateway computes it only then,
    or for a request it records in a trace."""
    conditions = any(item.when is not None and item.when.prompt_repeat is not None
                     for item in list(policy.slices) + list(policy.rules))
    return conditions or bool(policy.learning.repeat_bands) and any(_is_auto(r.then) for r in policy.rules)


def _is_auto(action: Any) -> bool:
    """Whether a rule's action is decided by ``auto`` (policies/decide.py ``_act``)."""
    return action == "auto" or (action != "bypass" and not isinstance(getattr(action, "draft_tokens", None), int))


def referenced_headers(policy: Any) -> set[str]:
    """Lowercase header names any slice or rule condition looks at; the gateway extracts only these."""
    names: set[str] = set()
    for item in list(policy.slices) + list(policy.rules):
        if item.when is not None and item.when.headers:
            names.update(h.lower() for h in item.when.headers)
    return names


def _message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def prompt_text(body: dict[str, Any]) -> str:
    """The text the estimators read: a chat request's message texts joined by newlines, or a completion's
    prompt."""
    if "messages" in body:
        return "\n".join(_message_text(m.get("content")) for m in body.get("messages") or [])
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else "\n".join(map(str, prompt))


def features_from_openai(body: dict[str, Any], *, route: str = "default", headers: dict[str, str] | None = None,
                         wanted_headers: set[str] | None = None, repeat: bool = True,
                         code: bool | Callable[[RequestFeatures], bool] = True,
                         slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
                         slo_tpot_stated: bool = False) -> RequestFeatures:
    """Features of an OpenAI chat/completions request body (already validated by the gateway);
    ``repeat=False`` leaves ``prompt_repeat`` None (not computed); ``code``: whether to compute ``code_score``
    (None when not), or a test of the other features that says whether it is needed
    (:func:`policies.slicing.needs_code_score`: up to ~0.3 ms on a long prompt, often never read);
    ``slo_*``: the request's SLO in force
    (``slo_tpot_stated``: its TPOT from the request's own header)."""
    text = prompt_text(body)
    fmt = body.get("response_format")
    fmt_type = fmt.get("type") if isinstance(fmt, dict) else None
    lowered = {k.lower(): v for k, v in (headers or {}).items()}
    if wanted_headers is not None:
        lowered = {k: v for k, v in lowered.items() if k in wanted_headers}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    features = RequestFeatures(
        route=route, model=str(body.get("model", "")), has_tools=bool(body.get("tools")),
        response_format=fmt_type if fmt_type in ("text", "json_object", "json_schema") else None,
        prompt_tokens=approx_tokens(text), max_tokens=max_tokens, temperature=body.get("temperature"),
        stream=bool(body.get("stream", False)), headers=lowered, code_score=None,
        prompt_repeat=prompt_repeat(text) if repeat else None, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms,
        slo_tpot_stated=slo_tpot_stated)
    if code is True or (code is not False and code(features)):
        return msgspec.structs.replace(features, code_score=code_score(text))
    return features

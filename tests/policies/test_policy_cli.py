"""`specgate policy check|schema|explain` as a user runs them (subprocess of the installed script)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPECGATE = str(Path(sys.executable).parent / "specgate")  # the script installed beside the running interpreter
DEFAULT = str(ROOT / "deploy" / "policies" / "default.yaml")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SPECGATE, "policy", *args], capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_check_valid_and_invalid(tmp_path: Path) -> None:
    ok = run("check", DEFAULT)
    assert ok.returncode == 0, ok.stderr
    assert "valid policy (version 1)" in ok.stdout and "rules: unverified-pair, degraded-pair, kv-pressure, tiny-budget, learned" \
        in ok.stdout
    # the default's one rule serves hybrid; the other speculative pools are declared for edits, and said so
    assert ("  not served by any rule: ngram, ngram-adaptive, draft (no rule speculates with them; each one's pair gate "
            "waits for a rule that does, or for POST /admin/pools/NAME/check)\n") in ok.stdout
    auto = tmp_path / "auto.yaml"
    auto.write_text(Path(DEFAULT).read_text().replace("then: {pools: [hybrid]}}", "then: auto}"))
    out = run("check", str(auto))
    assert out.returncode == 0 and "not served by any rule" not in out.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(DEFAULT).read_text().replace("then: {pools: [hybrid]}}", "then: {pool: ngramm}}"))
    out = run("check", str(bad))
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.splitlines()[0].startswith("bad.yaml:")
    assert out.stderr.splitlines()[0].endswith("rules[4] (Rule 'learned').then.pool: unknown pool 'ngramm'; "
                                                "declared pools: plain, ngram, ngram-adaptive, hybrid, draft")
    for path in sorted((ROOT / "deploy" / "policies" / "examples").glob("*.yaml")):
        assert run("check", str(path)).returncode == 0, path


def test_schema_is_json_schema_for_policy() -> None:
    out = run("schema")
    assert out.returncode == 0
    schema = json.loads(out.stdout)
    assert schema["$ref"] == "#/$defs/Policy"
    assert set(schema["$defs"]["Policy"]["required"]) == {"version", "slices", "pools"}
    import jsonschema
    import yaml
    jsonschema.validate(yaml.safe_load(Path(DEFAULT).read_text()), schema)


def test_explain_request_and_stats(tmp_path: Path) -> None:
    req = tmp_path / "req.json"
    req.write_text(json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 4,
                               "messages": [{"role": "user", "content": "Write a haiku."}]}))
    out = run("explain", DEFAULT, "--request", str(req))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "slice: prose (slices[4])"
    assert "rule tiny-budget: matched" in out.stdout
    assert "decision: pool plain, bypass (no speculation), rule tiny-budget" in out.stdout
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"pools": {"plain": {"healthy": True}, "ngram": {"healthy": True,
                                                                               "pair_verified": False}}}))
    req.write_text(json.dumps({"max_tokens": 64, "code_score": 0.9}))
    out = run("explain", DEFAULT, "--request", str(req), "--stats", str(stats), "--json")
    trace = json.loads(out.stdout)
    assert trace["slice"] == "code" and trace["decision"]["rule"] == "unverified-pair"
    req.write_text(json.dumps({"max_tokens": 64, "bogus": 1}))
    out = run("explain", DEFAULT, "--request", str(req))
    assert out.returncode == 1 and "bogus" in out.stderr


def test_explain_lists_every_auto_option_with_its_posterior(tmp_path: Path) -> None:
    from policies.load import load_policy_file

    pv = load_policy_file(DEFAULT).pool_pair_version("hybrid")
    # 20 code requests each (bucket 0, band 0): plain at 50 ms a token, the per-round pool at 25 ms
    arm = {"t_ref": 0.0, "w": 20.0, "ever": 20.0}
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({
        "half_life_s": 600.0, "pools": {p: {"healthy": True, "pair_verified": True} for p in
                                        ("plain", "ngram", "ngram-adaptive", "hybrid", "draft")},
        "arms": {"code|0|0|none": arm | {"sy": 20 * -2.995732, "syy": 20 * 2.995732 ** 2},
                 f"code|0|0|hybrid@16#{pv}": arm | {"sy": 20 * -3.688879, "syy": 20 * 3.688879 ** 2}}}))
    req = tmp_path / "req.json"
    req.write_text(json.dumps({"max_tokens": 64, "code_score": 0.9}))
    out = run("explain", DEFAULT, "--request", str(req), "--stats", str(stats))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "  option plain: TPOT 50.0 ms (sd 0.03 in log), speedup 1.00x, 20.0 requests here, p_best 0.00" in lines
    assert ("  option hybrid k=16: TPOT 25.0 ms (sd 0.03 in log), speedup 2.00x, 20.0 requests here, "
            "p_best 1.00") in lines
    assert "decision: pool hybrid, hybrid k=16, rule learned" in lines
    # each option's spread: a prior of 0.3^2 worth 4 requests and 19 requests' worth of zero spread ->
    # s2 = 0.36 / 23; over its 20 requests: sd sqrt(s2 / 20) = 0.03
    assert lines[-1] == "reason: rule 'learned' auto: pool 'hybrid' k=16, posterior-mean speedup 2.00x over plain"


def test_explain_reads_the_routes_slo_as_the_gateway_does(tmp_path: Path) -> None:
    """Without x-slo-* headers a request's SLO is its route's: a rule on ``slo_tpot_ms`` decides the same in
    ``explain`` as in the gateway; a features JSON states the SLO a header would have."""
    policy = tmp_path / "slo.yaml"
    text = Path(DEFAULT).read_text().replace("\nslo: {ttft_ms: 2000, tpot_ms: 150}", "\nslo: {ttft_ms: 2000, tpot_ms: 40}")
    policy.write_text(text.replace("\nrules:", "\nrules:\n  - {name: tight-tpot, when: {slo_tpot_ms: {lte: 50}}, "
                                   "then: bypass}\n#", 1))
    req = tmp_path / "req.json"
    req.write_text(json.dumps({"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi."}]}))
    out = run("explain", str(policy), "--request", str(req))
    assert out.returncode == 0, out.stderr
    assert "rule tight-tpot: matched" in out.stdout
    req.write_text(json.dumps({"max_tokens": 64, "slo_tpot_ms": 80}))
    out = run("explain", str(policy), "--request", str(req))
    assert "rule tight-tpot: no (slo_tpot_ms <= 50)" in out.stdout
    body = tmp_path / "body.json"
    body.write_text(json.dumps({"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi."}]}))
    out = run("explain", str(policy), "--request", str(body), "--slo-tpot-ms", "80")  # as x-slo-tpot-ms: 80
    assert out.returncode == 0, out.stderr
    assert "rule tight-tpot: no (slo_tpot_ms <= 50)" in out.stdout
    out = run("explain", str(policy), "--request", str(body), "--slo-tpot-ms", "80", "--json")
    assert json.loads(out.stdout)["features"]["slo_tpot_stated"] is True
    out = run("explain", str(policy), "--request", str(body), "--slo-tpot-ms", "fast")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith("error: header x-slo-tpot-ms must be a number of milliseconds > 0")
    out = run("explain", str(policy), "--request", str(req), "--slo-ttft-ms", "300")  # a features JSON
    assert out.returncode == 2 and "go with an OpenAI body" in out.stderr

"""Claims files and `crossrt reproduce`, run on the tiny pair with real llama.cpp."""

import json

import pytest
from click.testing import CliRunner

from crossrt.analyze.claims import ClaimError, Tolerance, load_claims
from crossrt.cli.reproduce import reproduce
from crossrt.records.record_json import load_record

from conftest import REPO, TINY_PAIR

COMMUNITY = REPO / "models" / "claims" / "community.toml"


def invoke(*args):
    return CliRunner().invoke(reproduce, [str(a) for a in args], catch_exceptions=False)


def claims_file(path, body, **fields):
    """One claim (id "mine") on the tiny pair at k=4, 64 tokens, with fields replaced or added, plus body."""
    values = {"id": "mine", "source": "test", "runtime": "llama.cpp", "crossrt_runtime": "llama-cpp",
              "pair": str(TINY_PAIR), "k": 4, "sampling": "greedy", "hardware": "Test Box", "max_new_tokens": 64}
    values.update(fields)
    head = "".join(f"{name} = {json.dumps(value)}\n" for name, value in values.items())
    path.write_text(f"[[claim]]\n{head}{body}")
    return path


def rows(output, claim_id):
    """(category, metric, measured, verdict) of claim_id's rows in the printed table."""
    found = []
    for line in output.splitlines():
        cells = line.split(None, 6)
        if cells and cells[0] == claim_id and len(cells) == 7:
            found.append((cells[1], cells[2], cells[5], cells[6]))
    return found


def test_shipped_claims_tiny_reproduces_and_community_is_not_run_here(tmp_path):
    result = invoke(COMMUNITY, "--out-dir", tmp_path)
    assert result.exit_code == 0, result.output
    tiny = rows(result.output, "tiny-llama-cpp-k4")
    assert len(tiny) == 8 and {verdict for *_, verdict in tiny} == {"ok"}
    assert ("prose", "tau", "3.32", "ok") in tiny and ("all", "alpha", "0.616", "ok") in tiny
    record = load_record(tmp_path / "tiny-llama-cpp-k4.json")
    assert record.params.k == 4 and len(record.results) == 10 and record.runtime.threads == 1
    assert round(record.summary("code").tau, 2) == 3.37
    exl3 = rows(result.output, "community-exllamav3-dflash2")
    assert ("code", "tau", "-", "not run") in exl3 and len(exl3) == 5
    assert "not run here: pair 'community-qwen3.8-27b-dflash2'" in result.output
    assert "the target's exl3 path is left empty" in result.output
    assert result.output.count("the target's gguf path is left empty") == 2  # both llama.cpp claims
    assert "MISS" not in result.output
    assert result.output.rstrip().endswith("4 claim(s): 1 reproduced, 3 not run here")


def test_strict_fails_on_claims_that_could_not_run(tmp_path):
    # Alone, the claim compares no number here: a verdict about nothing fails, strict or not.
    alone = invoke(COMMUNITY, "--claim", "community-llama-cpp-mtp-prose", "--out-dir", tmp_path)
    assert alone.exit_code == 1 and "nothing compared: none of the 1 claimed number(s) was measured" in alone.output
    strict = invoke(COMMUNITY, "--claim", "community-llama-cpp-mtp-prose", "--out-dir", tmp_path, "--strict")
    assert strict.exit_code == 1 and "the target's gguf path is left empty" in strict.output
    assert not list(tmp_path.iterdir())  # nothing ran


def test_a_wrong_claim_fails_with_a_readable_line(tmp_path):
    path = claims_file(tmp_path / "wrong.toml", "[claim.expect.prose]\ntau = 5.0\n[claim.expect.code]\ntau = 3.37\n",
                       prompts="builtin")
    result = invoke(path, "--out-dir", tmp_path / "runs")
    assert result.exit_code == 1
    assert "  MISS prose tau: claimed 5 ±10% (accepts 4.5 to 5.5), measured 3.32" in result.output
    assert ("code", "tau", "3.37", "ok") in rows(result.output, "mine")
    assert "1 claim(s): 1 missed" in result.output


def test_speeds_compare_only_on_the_declared_same_hardware(tmp_path):
    path = claims_file(tmp_path / "speed.toml", "[claim.expect.code]\ntau = 3.37\ntokens_per_s = 1e9\n",
                       prompts="builtin")
    elsewhere = invoke(path, "--out-dir", tmp_path, "--hardware", "another box")
    assert elsewhere.exit_code == 0, elsewhere.output
    assert rows(elsewhere.output, "mine")[1][3] == "not comparable here"
    assert "claimed on 'Test Box', this machine: another box" in elsewhere.output
    assert "1 partly checked" in elsewhere.output
    assert invoke(path, "--out-dir", tmp_path, "--resume", "--strict").exit_code == 1
    same = invoke(path, "--out-dir", tmp_path, "--resume", "--hardware", "test  BOX")
    assert same.exit_code == 1 and "MISS code tokens_per_s: claimed 1e+09" in same.output


def test_per_category_suites_are_relabelled_and_missing_categories_reported(tmp_path):
    humaneval = tmp_path / "HumanEval.jsonl"
    humaneval.write_text(json.dumps({"task_id": "HumanEval/0", "prompt": "def add(a, b):\n",
                                     "entry_point": "add", "canonical_solution": "    return a + b\n",
                                     "test": "def check(c):\n    assert c(1, 2) == 3\n"}) + "\n")
    body = ('[claim.prompts]\ncoding = "humaneval:HumanEval.jsonl"\nprose = "prose"\n'
            "[claim.tolerance]\ntau = 10\n[claim.expect.coding]\ntau = 1.0\n[claim.expect.prose]\ntau = 3.0\n")
    path = claims_file(tmp_path / "suites.toml", body)
    result = invoke(path, "--out-dir", tmp_path / "runs", "--max-new-tokens", 16)
    assert result.exit_code == 0, result.output
    record = load_record(tmp_path / "runs" / "mine.json")
    assert record.categories() == ["coding", "prose"]
    assert [r.prompt_id for r in record.results if r.category == "coding"] == ["HumanEval/0"]
    assert sum(r.category == "prose" for r in record.results) >= 20

    math_too = claims_file(tmp_path / "math.toml", "[claim.expect.code]\ntau = 3.37\n[claim.expect.math]\ntau = 3.0\n",
                           prompts="builtin")
    result = invoke(math_too, "--out-dir", tmp_path / "runs")
    assert result.exit_code == 0, result.output
    assert ("math", "tau", "-", "not run") in rows(result.output, "mine")
    assert "no prompt of category 'math' in the suite" in result.output
    assert invoke(math_too, "--out-dir", tmp_path / "runs", "--strict").exit_code == 1


def test_claims_that_cannot_run_list_every_reason(tmp_path):
    path = claims_file(tmp_path / "no.toml", "[claim.expect.math]\ntau = 2.0\n", pair="missing.toml",
                       crossrt_runtime="llama-spec-cli", sampling="temperature 0.7", mode="driven", prompts="builtin")
    result = invoke(path, "--out-dir", tmp_path / "runs")
    assert result.exit_code == 1, result.output  # no number compared
    for reason in ("sampling 'temperature 0.7': crossrt decodes greedily only",
                   "runtime 'llama-spec-cli' has no driven mode",
                   "pair manifest not found: missing.toml",
                   "none of the claimed categories (math) is in the prompt suite 'builtin'"):
        assert f"not run here: {reason}" in result.output
    assert not (tmp_path / "runs").exists()

    community_pair = REPO / "models" / "pairs" / "community-qwen3.8-27b-dflash2.toml"
    path = claims_file(tmp_path / "other.toml", "[claim.expect.code]\ntau = 2.0\n", pair=str(community_pair),
                       crossrt_runtime="sglang", spec_type="eagle3")
    result = invoke(path, "--out-dir", tmp_path / "runs")
    assert "not run here: unknown runtime 'sglang'" in result.output
    assert "its model paths are left empty; fill them in" in result.output
    path = claims_file(tmp_path / "mtp.toml", "[claim.expect.code]\ntau = 2.0\n", spec_type="mtp")
    result = invoke(path, "--out-dir", tmp_path / "runs", "--strict")
    assert result.exit_code == 1
    assert "not run here: spec_type 'mtp': crossrt's driven loop drafts with a drafter model or a head" \
        in result.output


def test_a_claim_naming_no_spec_type_drafts_as_its_pair_does(tmp_path):
    """An EAGLE3 pair's claim ran its head as a plain draft model (llama.cpp accepted nothing)."""
    from crossrt.analyze.reproduce import Settings, plan_claim
    from crossrt.run.runtime import RuntimeOptions

    (claim,) = [c for c in load_claims(REPO / "models" / "claims" / "measured.toml") if "eagle3" in c.id]
    assert claim.spec_type is None  # the pair's: SmolLM2's manifest says eagle3
    settings = Settings(RuntimeOptions(threads=1), 64, "builtin", tmp_path, None, False)
    plan, reasons = plan_claim(claim, settings)
    if plan is None and any("not found" in reason or "unusable" in reason for reason in reasons):
        pytest.skip(f"the SmolLM2 pair is not set up here: {reasons}")
    assert plan is not None, reasons
    assert plan.request.rules.spec_type == "eagle3" and plan.request.mode == "native"


def test_a_run_that_breaks_fails_the_command(tmp_path):
    broken = tmp_path / "drafter.gguf"
    broken.write_bytes(b"not a gguf file")
    manifest = tmp_path / "broken.toml"
    manifest.write_text(f'name = "broken"\n[target]\ngguf = "{REPO / "models/tiny/target.f32.gguf"}"\n'
                        f'[drafter]\ngguf = "{broken}"\n')
    path = claims_file(tmp_path / "claims.toml", "[claim.expect.code]\ntau = 3.37\n", pair="broken.toml",
                       prompts="builtin")
    result = invoke(path, "--out-dir", tmp_path / "runs")
    assert result.exit_code == 1
    assert "run failed: " in result.output and "is not a readable GGUF file" in result.output
    assert "1 claim(s): 1 failed to run" in result.output


def test_help_names_the_prompt_formats():
    result = invoke("--help")
    assert result.exit_code == 0
    assert all(scheme in result.output for scheme in ("specbench:PATH", "mtbench:PATH", "humaneval:PATH"))


@pytest.mark.parametrize("body, message", [
    ("[claim.expect.code]\ntau = 2\nspeed = 3\n", "claim 'mine': expect.code.speed: unknown metric"),
    ("[claim.expect.code]\ntau = [3, 2]\n", "expect.code.tau: expected a non-negative number or a range"),
    ("[claim.expect.code]\ntau = 2\n[claim.tolerance]\ntau = \"ten%\"\n", "tolerance.tau: 'ten%' is not a percentage"),
    ("[claim.expect.code]\ntau = 2\n[claim.tolerance]\ntau = \"150%\"\n", "tolerance.tau: tolerance '150%' out of range"),
    ("[claim.expect.code]\ntau = 2\n[claim.tolerance]\ntau = true\n", "a tolerance is a number (absolute)"),
    ('flavour = "x"\n[claim.expect.code]\ntau = 2\n', "unknown field(s) flavour"),
    ('schedule = "fast"\n[claim.expect.code]\ntau = 2\n', "schedule must be one of crossrt"),
    ('spec_type = "medusa"\n[claim.expect.code]\ntau = 2\n', "spec_type must be one of draft"),
    ('template = "jinja"\n[claim.expect.code]\ntau = 2\n', "template must be one of auto, chat, raw"),
    ('prompts = {code = "code"}\n[claim.expect.code]\ntau = 2\n[claim.expect.prose]\ntau = 2\n',
     "missing ['prose']"),
    ("", "missing field(s) expect"),
])
def test_bad_claims_name_the_file_and_claim(tmp_path, body, message):
    path = claims_file(tmp_path / "bad.toml", body)
    with pytest.raises(ClaimError) as error:
        load_claims(path)
    assert str(path) in str(error.value) and message in str(error.value)


def test_duplicate_ids_and_unknown_claim_selection(tmp_path):
    one = claims_file(tmp_path / "one.toml", "[claim.expect.code]\ntau = 2\n")
    two = claims_file(tmp_path / "two.toml", "[claim.expect.code]\ntau = 2\n")
    result = invoke(one, two)
    assert result.exit_code == 1 and "claim id(s) mine appear in more than one claims file" in result.output
    result = invoke(one, "--claim", "nope")
    assert result.exit_code == 1 and "no claim 'nope' (claims: mine)" in result.output
    result = invoke(tmp_path / "absent.toml")
    assert result.exit_code == 1 and "claims file not found" in result.output


def test_tolerances_widen_ranges_relatively_or_absolutely():
    assert Tolerance(0.1, relative=True).bounds(35, 37) == pytest.approx((31.5, 40.7))
    assert Tolerance(0.2, relative=False).bounds(2.5, 2.5) == pytest.approx((2.3, 2.7))
    assert (str(Tolerance(0.1, True)), str(Tolerance(0.25, False))) == ("±10%", "±0.25")


def test_a_claim_runs_with_its_template_use_and_says_it(tmp_path):
    """template = "chat": every prompt rendered through the tiny pair's chat template
    (models/templates/tiny-chat.jinja), as the claim says its numbers were measured; the setting
    is printed beside the numbers, and the record keeps it."""
    path = claims_file(tmp_path / "chat.toml", "[claim.expect.code]\ntau = 1\n[claim.tolerance]\ntau = 10\n",
                       prompts="builtin", template="chat", max_new_tokens=16)
    result = invoke(path, "--out-dir", tmp_path)
    assert result.exit_code == 0, result.output
    assert "  prompts: builtin, template chat" in result.output
    chat = load_record(tmp_path / "mine.json")
    assert chat.prompt_format.mode == "chat" and len(chat.prompt_format.templated) == len(chat.results) == 4
    # The same claim fed raw: other prompt ids.
    path = claims_file(tmp_path / "raw.toml", "[claim.expect.code]\ntau = 1\n[claim.tolerance]\ntau = 10\n",
                       id="mine-raw", prompts="builtin", template="raw", max_new_tokens=16)
    assert invoke(path, "--out-dir", tmp_path).exit_code == 0
    fed_raw = load_record(tmp_path / "mine-raw.json")
    assert fed_raw.prompt_format.templated == ()
    assert all(a.prompt_ids != b.prompt_ids for a, b in zip(chat.results, fed_raw.results, strict=True))

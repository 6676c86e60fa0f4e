"""Chat templates: crossrt's rendering against transformers' own (the same jinja rules), the
text fed (one BOS), template sources, and template parity on real runtimes: the tiny pair's
template (models/templates/tiny-chat.jinja) through llama-cpp, llama-server and transformers
gives the same prompt ids from one rendering, and a rendering with a doubled BOS is reported
as a template split by parity and diff."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossrt.inputs.chat_template import (ChatRendering, ChatTemplateError, apply_template, find_template, template_variables,
                                   user_turn)
from crossrt.cli import main
from crossrt.compare.diagnosis import Explainer, explain_record
from crossrt.compare.splits import TEMPLATE
from crossrt.compare.diff import diff_records, render_diff
from crossrt.run.driver import RunRequest, run_pair
from crossrt.inputs.pairs import load_pair
from crossrt.compare.parity import compare_all
from crossrt.inputs.prompts import Prompt, PromptError, load_prompts
from crossrt.records.record_json import load_record
from crossrt.run.runtime import DraftRules, RuntimeOptions, availability
from crossrt.records.schema import RecordError

from conftest import REPO, TINY_PAIR

TEMPLATE_FILE = REPO / "models" / "templates" / "tiny-chat.jinja"
OPTIONS = RuntimeOptions(n_ctx=512, threads=1)
PROMPTS = [Prompt("hello", "chat", "Hello, how are you today?", chat=True),
           Prompt("plan", "chat", "Plan a short walk by the river.", chat=True),
           Prompt("code", "code", "def add(a, b):")]
# (runtime, mode): each renders the template itself, except llama-cpp in-process.
RUNS = (("llama-cpp", "driven"), ("llama-server", "native"), ("transformers", "driven"))
CONVERSATIONS = [
    user_turn("  Hello there.  "),
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
]


def usable(name: str) -> None:
    reason = availability(name)
    if reason is not None:
        pytest.skip(f"{name} not usable: {reason}")


@pytest.fixture(scope="module")
def hf_tokenizer():
    usable("transformers")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(REPO / "models" / "tiny" / "target-hf")


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_rendering_matches_transformers(tiny_pair, hf_tokenizer, messages):
    rendering = ChatRendering(find_template(tiny_pair))
    ours = rendering.render(messages)
    theirs = hf_tokenizer.apply_chat_template(messages, chat_template=rendering.template.text,
                                              add_generation_prompt=True, tokenize=False)
    assert ours == theirs
    assert ours.startswith("<|bos|>### user:\n") and ours.endswith("### assistant:\n")


def test_template_variables_override_and_parse(tiny_pair):
    template = dataclasses.replace(find_template(tiny_pair), text="{{ bos_token }}|{{ flag }}|{{ n + 1 }}|{{ word }}")
    variables = template_variables(["flag=false", "n=2", "word=hi", "bos_token=<s>"])
    assert ChatRendering(template, variables).render(user_turn("x")) == "<s>|False|3|hi"
    with pytest.raises(ChatTemplateError, match="NAME=VALUE"):
        template_variables(["no-equals-sign"])


def test_template_errors_name_the_template(tiny_pair):
    rendering = ChatRendering(find_template(tiny_pair))
    with pytest.raises(ChatTemplateError, match="user and assistant turns only"):
        rendering.render([{"role": "system", "content": "be brief"}])
    with pytest.raises(ChatTemplateError, match="line 1"):
        ChatRendering(dataclasses.replace(rendering.template, text="{% for %}")).render(user_turn("x"))


def test_sources_in_order(tiny_pair, tmp_path):
    assert find_template(tiny_pair).source == f"file:{TEMPLATE_FILE}"
    override = tmp_path / "other.jinja"
    override.write_text("{{ messages[0]['content'] }}")
    assert find_template(tiny_pair, override).text == "{{ messages[0]['content'] }}"
    # The tiny-f16 manifest names no template and its GGUF has none: raw.
    assert find_template(load_pair(REPO / "models" / "pairs" / "tiny-f16.toml")) is None
    # An HF folder's chat_template.jinja, then tokenizer_config.json's chat_template.
    folder = tmp_path / "hf"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "models" / "tiny" / "target-hf" / name, folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "from config"}))
    pair = dataclasses.replace(tiny_pair, files={"target": {"hf": str(folder)}}, source=None)
    assert (find_template(pair).text, find_template(pair).source) == ("from config", f"hf:{folder / 'tokenizer_config.json'}")
    (folder / "chat_template.jinja").write_text("from jinja file")
    found = find_template(pair)
    assert (found.text, found.bos_token, found.add_bos) == ("from jinja file", "<|bos|>", True)


def test_modes_and_fed_text(tiny_pair):
    fed, rendering, fmt = apply_template(PROMPTS, tiny_pair)
    assert [p.rendered_from is not None for p in fed] == [True, True, False]
    # The model adds its own BOS: the rendering's is dropped from the text fed.
    assert fed[0].text == "### user:\nHello, how are you today?\n### assistant:\n"
    assert (fmt.mode, fmt.templated, fmt.template_sha256) == ("auto", ("hello", "plan"), rendering.template.sha256)
    fed, _, fmt = apply_template(PROMPTS, tiny_pair, "chat")
    assert fmt.templated == ("hello", "plan", "code")
    fed, rendering, fmt = apply_template(PROMPTS, tiny_pair, "raw")
    assert fed == PROMPTS and rendering is None and fmt.template is None
    raw_pair = load_pair(REPO / "models" / "pairs" / "tiny-f16.toml")
    assert apply_template(PROMPTS, raw_pair)[0] == PROMPTS
    with pytest.raises(ChatTemplateError, match="no chat template"):
        apply_template(PROMPTS, raw_pair, "chat")


def _run(pair, runtime, mode, prompts, rendering, fmt, out: Path):
    usable(runtime)
    request = RunRequest(pair, runtime, OPTIONS, DraftRules(4), 6, out, mode, overwrite=True, chat=rendering,
                         prompt_format=fmt)
    run_pair(request, prompts)
    return load_record(out)  # validated against the JSON Schema on the way back


def test_one_rendering_same_ids_on_every_runtime(tiny_pair, tmp_path):
    prompts, rendering, fmt = apply_template(PROMPTS, tiny_pair)
    records = {runtime: _run(tiny_pair, runtime, mode, prompts, rendering, fmt, tmp_path / f"{runtime}.json")
               for runtime, mode in RUNS}
    ids = {runtime: [r.prompt_ids for r in record.results] for runtime, record in records.items()}
    assert ids["llama-cpp"] == ids["llama-server"] == ids["transformers"]
    assert ids["llama-cpp"][0][0] == 0 and ids["llama-cpp"][0][1] != 0  # one BOS
    for record in records.values():
        assert record.prompt_format == fmt
        assert all(r.ok and r.template_ids is None and r.own_prompt_ids is None for r in record.results)
    checks = compare_all([(f"{name}", record) for name, record in records.items()])
    assert not any("template" in problem for check in checks for problem in check.problems)


def test_doubled_bos_is_a_template_split(tiny_pair, tmp_path):
    """crossrt's rendering fed with the template's BOS kept, so the model's BOS doubles it: the
    runtimes that render the template themselves feed one BOS, and say so."""
    rendering = ChatRendering(find_template(tiny_pair))
    doubled = [dataclasses.replace(p, text=rendering.render(user_turn(p.text)), rendered_from=p.text)
               for p in PROMPTS[:2]]
    records = {runtime: _run(tiny_pair, runtime, mode, doubled, rendering, None, tmp_path / f"{runtime}.json")
               for runtime, mode in RUNS}
    assert all(r.prompt_ids[:2] == (0, 0) for r in records["llama-cpp"].results)
    assert all(r.template_ids is None for r in records["llama-cpp"].results)  # renders no template itself
    for runtime in ("llama-server", "transformers"):
        for result in records[runtime].results:
            assert result.template_ids == result.prompt_ids[1:]
        splits = explain_record(runtime, records[runtime], Explainer())
        assert [(s.prompt_id, s.index) for s in splits if s.kind == TEMPLATE] == [(p.id, 1) for p in doubled]
    checks = compare_all([(name, record) for name, record in records.items()])
    flagged = {(c.run_a, c.prompt_id) for c in checks for p in c.problems if p.startswith("template split")}
    assert flagged == {(runtime, p.id) for runtime in ("llama-server", "transformers") for p in doubled}
    report = diff_records("llama-server/native", records["llama-server"], "transformers/driven", records["transformers"])
    assert [d.tokenization.kind for d in report.divergences] == [TEMPLATE, TEMPLATE]
    text = render_diff(report)
    assert "verdict: template: llama-server/native renders the chat template itself" in text
    assert "'###" in text  # the differing tokens decoded, not only their ids


def test_template_without_bos(tiny_pair, tmp_path):
    """A template that writes no bos_token: crossrt (and llama.cpp) feed the model's BOS, while
    transformers' apply_chat_template adds no special tokens at all: a real template split."""
    no_bos = tmp_path / "no-bos.jinja"
    no_bos.write_text(TEMPLATE_FILE.read_text().replace("{{ bos_token }}\n", ""))
    prompts, rendering, fmt = apply_template(PROMPTS[:1], tiny_pair, template_file=no_bos)
    assert fmt.template == f"file:{no_bos}"
    server = _run(tiny_pair, "llama-server", "native", prompts, rendering, fmt, tmp_path / "server.json")
    hf = _run(tiny_pair, "transformers", "driven", prompts, rendering, fmt, tmp_path / "hf.json")
    assert server.results[0].template_ids is None
    assert server.results[0].prompt_ids[0] == 0 and hf.results[0].template_ids == server.results[0].prompt_ids[1:]


def test_cli_parity_with_chat_prompts(tmp_path):
    usable("transformers")
    source = tmp_path / "chat.jsonl"
    source.write_text("".join(json.dumps({"id": p.id, "category": p.category, "prompt": p.text, "chat": p.chat}) + "\n"
                              for p in PROMPTS))
    result = CliRunner().invoke(main, ["parity", "--pair", str(TINY_PAIR), "--runtimes", "llama-cpp,transformers",
                                       "--modes", "driven", "--prompts", str(source), "--max-new-tokens", "6",
                                       "--f32-kv-cache", "--no-flash-attn", "--out-dir", str(tmp_path / "runs")])
    assert result.exit_code == 0, result.output
    record = load_record(tmp_path / "runs" / "tiny-transformers-driven-k4.json")
    assert record.prompt_format.templated == ("hello", "plan")
    result = CliRunner().invoke(main, ["run", "--pair", str(TINY_PAIR), "--prompts", str(source), "--raw",
                                       "--max-new-tokens", "4", "--out", str(tmp_path / "raw.json")])
    assert result.exit_code == 0, result.output
    assert load_record(tmp_path / "raw.json").prompt_format.templated == ()


def test_load_prompts_chat_flag(tmp_path):
    source = tmp_path / "p.jsonl"
    source.write_text('{"id": "a", "category": "chat", "prompt": "hi", "chat": "yes"}\n')
    with pytest.raises(PromptError, match="'chat' must be true or false"):
        load_prompts(str(source))


def test_resume_keeps_the_format_and_refuses_another_rendering(tiny_pair, tmp_path):
    out = tmp_path / "run.json"
    prompts, rendering, fmt = apply_template(PROMPTS, tiny_pair)
    request = RunRequest(tiny_pair, "llama-cpp", OPTIONS, DraftRules(4), 4, out, chat=rendering, prompt_format=fmt)
    run_pair(request, prompts[:1])
    record = run_pair(dataclasses.replace(request, resume=True), prompts)
    assert [r.prompt_id for r in record.results] == ["hello", "plan", "code"] and record.prompt_format == fmt
    raw, _, raw_format = apply_template(PROMPTS, tiny_pair, "raw")
    with pytest.raises(RecordError, match="prompt 'hello' of the prompt source is not the text"):
        run_pair(dataclasses.replace(request, resume=True, chat=None, prompt_format=raw_format), raw)

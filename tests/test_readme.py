"""The README as a user reads it: its snippet is the example script's code and defines every name
it uses, its links lead to files in the checkout, and each number of its results table is in the
results file its row cites."""

import builtins
import os
import re
import symtable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
EXAMPLE = os.path.join(ROOT, "scripts", "torchrec_dlrm_example.py")


def _readme() -> str:
    with open(README, encoding="utf-8") as f:
        return f.read()


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def _snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", _section(_readme(), "LoKA in your TorchRec job"), flags=re.S)
    assert len(blocks) == 1, "the section holds one python block"
    return blocks[0]


def test_the_readme_is_short():
    assert _readme().count("\n") <= 150


def test_the_snippet_is_the_example_scripts_code():
    with open(EXAMPLE, encoding="utf-8") as f:
        script = f.read()
    marked = re.search(r"# README: begin\n(.*?)# README: end\n", script, flags=re.S)
    assert marked is not None, "the example marks the README's part"
    assert _snippet() == marked.group(1)


def test_the_snippet_defines_every_name_it_uses():
    source = _snippet()
    namespace: dict = {}
    exec(compile(source, "README.md", "exec"), namespace)  # the imports resolve, train is defined
    assert callable(namespace["train"])
    table = symtable.symtable(source, "README.md", "exec")
    (train,) = [t for t in table.get_children() if t.get_name() == "train"]
    undefined = [n for n in train.get_globals() if n not in namespace and not hasattr(builtins, n)]
    assert not undefined, f"used by train but defined nowhere: {undefined}"


def test_the_links_lead_to_files_in_the_checkout_and_not_to_archives():
    links = re.findall(r"\]\(([^)#]+)\)", _readme())
    assert links
    for link in links:
        assert not link.endswith(".tar.gz"), link
        if not re.match(r"[a-z]+://", link):
            assert os.path.exists(os.path.join(ROOT, link)), link


def test_each_results_number_is_in_the_file_its_row_cites():
    rows = [line for line in _section(_readme(), "Results").splitlines() if line.startswith("| `")]
    assert rows
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        (source,) = re.findall(r"\]\(([^)]+)\)", cells[-1])
        with open(os.path.join(ROOT, source), encoding="utf-8") as f:
            text = f.read()
        for cell in cells[5:-1]:  # the measurements: ms (bf16, torchao, LoKA), speedup, GEMMs in FP8, NE delta
            if not cell:
                continue  # not measured in that call
            value = cell.rstrip("x%")
            assert re.fullmatch(r"[+-]?\d+(\.\d+)?(/\d+)?", value), f"one number per cell: {cell!r}"
            assert re.search(rf"(?<![\d.]){re.escape(value)}(?![\d])", text), f"{value} is not in {source}"


def test_the_two_commands_stay():
    section = _section(_readme(), "Two commands")
    assert "scripts/run.sh " in section and "scripts/test.sh " in section

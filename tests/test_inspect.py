"""dsv41 inspect: the released figures of docs/PARAMETERS.md, a small model's saved checkpoint, text, JSON, pages."""

import json
import math
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from dsv41.checkpoint import CheckpointDir
from dsv41.checkpoint.model_io import save_model
from dsv41.config import RELEASED_CONFIG, ModelConfig, RuntimeConfig
from dsv41.model.init import init_random_
from dsv41.inspect import docs, inspect_model, main, render_text, to_dict, write_html
from dsv41.inspect.locations import build_meta_model
from dsv41.inspect.mathml import MathMLError, to_mathml
from dsv41.model import Transformer
from dsv41.inspect.roles import seed_groups

CONFIG = RELEASED_CONFIG

# docs/PARAMETERS.md §5, in the seed documents' order (§7).
SEED_GROUPS = [
    ("Window layer", 13_754_511_990), ("Engram", 98_462_906_368), ("Window layer", 13_754_511_990),
    ("Pooled group", 165_075_575_432), ("Engram", 98_465_597_952), ("Pooled group", 82_537_787_716),
    ("Token group", 55_026_142_296), ("Re-indexing group", 220_093_818_720),
]
SEED_TOTAL = 747_170_852_464
ALL_KINDS = {"model", "stack", "block", "attention", "compressor", "indexer", "candidate", "sparse_attention", "moe",
             "router", "expert", "hyper_connections", "engram", "engram_gate", "dspark_stage", "vision", "aligner",
             "head", "embedding", "norm"}


def small_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=256, dim=64, moe_inter_dim=32, n_layers=8, n_heads=4, n_routed_experts=4, n_shared_experts=1,
        n_activated_experts=2, q_lora_rank=32, head_dim=64, rope_head_dim=16, o_groups=2, o_lora_rank=32,
        window_size=8, compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1), kv_source_layers=(2, 4), index_source_layers=(2, 4, 6),
        index_n_heads=2, index_head_dim=32, index_topk=4, candidate_source_layer=4, candidate_topk_blocks=2,
        candidate_block_size=2, route_scale=1.5, swiglu_limit=10.0, original_seq_len=64, rope_factor=4,
        compress_rope_theta=160000.0)


def base_block_by_formula(c: ModelConfig) -> int:
    """docs/PARAMETERS.md §2 written out: attention, router (+ bias_vl in a vision build), experts, norms, hc."""
    attention = (c.n_heads + c.dim * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * c.n_heads * c.head_dim
                 + c.dim * c.head_dim + c.head_dim
                 + (c.n_heads * c.head_dim // c.o_groups) * c.o_groups * c.o_lora_rank + c.o_groups * c.o_lora_rank * c.dim)
    e = c.n_routed_experts
    router = e * c.dim + e + (e if c.vision_n_layers > 0 else 0)
    experts = (e + 1) * 3 * c.dim * c.moe_inter_dim
    mix = (2 + c.hc_mult) * c.hc_mult
    hc = 2 * (mix * c.hc_mult * c.dim + mix + 3)
    return attention + router + experts + 2 * c.dim + hc


def counted_by_convention(specs) -> int:
    """docs/PARAMETERS.md §1 applied to stored tensors: ue8m0 scales out, packed fp4 bytes count twice."""
    total = 0
    for s in specs:
        if s.dtype == "F8_E8M0" and s.name.endswith(".scale"):
            continue
        total += math.prod(s.shape) * (2 if s.dtype == "I8" else 1)
    return total


@pytest.fixture(scope="module")
def report():
    return inspect_model(CONFIG)


@pytest.fixture(scope="module")
def saved_small(tmp_path_factory):
    cfg = small_config()
    model = Transformer(cfg, RuntimeConfig(max_seq_len=64))
    init_random_(model, 0)
    directory = tmp_path_factory.mktemp("small_ckpt")
    save_model(model, directory)
    return cfg, directory


# ------------------------------------------------------------------------------ released figures
def test_released_total_and_seed_groups(report):
    acc = report.accounting
    assert acc.layers.parameters == SEED_TOTAL == acc.value("blocks")
    groups = acc.groups()
    assert [(g.name, g.parameters) for g in groups] == SEED_GROUPS
    assert sum(g.parameters for g in groups) == SEED_TOTAL
    assert [g.where for g in groups] == ["0", "before 1", "1", "2–13", "before 14", "14–19", "20–23", "24–39"]
    assert groups[3].calculation == "2 · [6W + 5,243,392 + 5,472,384] = 2 · 82,537,787,716"
    assert groups[7].calculation == "4 · [4W + 5,406,720] = 4 · 55,023,454,680"


def test_released_engram(report):
    acc = report.accounting
    assert acc.engram_gates() == {1: 40_960, 14: 40_960} and acc.value("engram_gate") == 40_960
    gate = acc.engram(1).child("gate")
    assert [(p.name, p.shape, p.parameters) for p in gate.parts.values()] == [
        ("engram.q_weight", (4, 5120), 20_480), ("engram.k_weight", (4, 5120), 20_480)]
    for layer, rows, total in ((1, 384_006_168, 98_462_906_368), (14, 384_016_682, 98_465_597_952)):
        engram = acc.engram(layer)
        assert engram.child("table").parameters == rows * 256
        assert engram.child("wkv").parameters == 6144 * 25600 == 157_286_400
        assert engram.parameters == total


def test_released_base_block(report):
    acc = report.accounting
    block = acc.block(0)
    assert acc.base_block == 13_754_511_990 == base_block_by_formula(report.cfg)
    assert block.child("attention").parameters == 126_617_408
    parts = {p.name: p.parameters for _, n in block.walk() for p in n.parts.values()}
    assert parts["attn.wq_b"] == 41_943_040 and parts["attn.wo_a"] == 33_554_432 and parts["attn.attn_sink"] == 64
    assert parts["ffn.gate.bias_vl"] == 384 and parts["hc_attn_fn"] == 491_520
    assert block.find("MoE", "routed experts").parameters == 13_589_544_960 == 384 * 35_389_440
    assert block.find("MoE", "shared expert").parameters == 35_389_440


def test_released_add_ons_and_layer_totals(report):
    acc = report.accounting
    add_ons = {a.label: (a.layers, a.parameters) for a in acc.add_on_rows()}
    assert add_ons == {
        "ratio-2 compressor (wkv, wgate, norm)": ((2, 8, 14), 5_243_392),
        "ratio-1 compressor (wkv, norm)": ((20,), 2_621_952),
        "indexer owning its keys (wq_b, weights_proj, wk, k_norm)": ((2, 8, 14, 20), 5_472_384),
        "indexer without keys (wq_b, weights_proj)": ((24, 28, 32, 36), 5_406_720),
    }
    expected = {layer: 13_754_511_990 for layer in range(40)}
    expected.update({2: 13_765_227_766, 8: 13_765_227_766, 14: 13_765_227_766, 20: 13_762_606_326})
    expected.update({layer: 13_759_918_710 for layer in (24, 28, 32, 36)})
    assert {r.layer: r.parameters for r in acc.layer_rows()} == expected


def test_released_alternative_conventions(report):
    acc = report.accounting
    assert acc.value("blocks_text_only") == 747_170_837_104 == SEED_TOTAL - 40 * 384
    assert acc.value("blocks_fp4_stored") == 475_379_953_264
    assert acc.value("blocks_embed_head_norm") == 748_494_684_784
    assert acc.value("model_logical") == 763_205_315_794
    assert acc.value("model_stored") == 484_619_644_114
    assert acc.value("dspark") == 14_225_362_530 == 3 * 4_693_504_118 + 144_850_176
    assert acc.value("dspark_stage") == 4_693_504_118 and acc.value("dspark_extras") == 144_850_176
    assert acc.value("vision") == 411_842_560 and acc.value("aligner") == 73_410_560
    assert acc.value("image_markers") == 3 * 5120
    assert acc.value("embed") == acc.value("head") == 661_913_600 and acc.value("norm") == 5120
    for key in ("blocks_text_only", "blocks_fp4_stored", "blocks_embed_head_norm"):
        assert "against the seed convention" in acc.figures[key].note


def test_released_scale_elements(report):
    acc = report.accounting
    assert acc.value("model_scales") == 23_561_606_160 and acc.value("blocks_scales") == 23_136_479_760
    wo_a_scale = math.ceil(8192 / 32) * math.ceil(4096 / 32)  # stored in the checkpoint, dequantised at load
    assert acc.value("model_scales_checkpoint") - acc.value("model_scales") == 43 * wo_a_scale
    assert acc.value("blocks_scales_checkpoint") - acc.value("blocks_scales") == 40 * wo_a_scale
    # The model as dsv41 builds it (meta device) holds exactly the "as built" block scales.
    model = build_meta_model(report.cfg)
    held = sum(t.numel() for n, t in model.state_dict(keep_vars=True).items()
               if n.startswith("layers.") and n.endswith(".scale") and t.dtype == torch.float8_e8m0fnu)
    assert held == acc.value("blocks_scales")


def test_tree_is_consistent_with_inventory(report):
    inventory = report.accounting.inventory
    assert len(inventory) == 96_085  # docs/CHECKPOINT.md §3.5
    root = report.tree
    assert root.stored + root.scales == sum(s.numel for s in inventory.values())
    assert root.parameters == counted_by_convention(inventory.values())
    for _, node in root.walk():
        members = list(node.parts.values()) + list(node.children.values())
        assert node.parameters == sum(m.parameters for m in members)


# ------------------------------------------------------------------------------ a small saved model
def test_small_accounting_equals_saved_checkpoint(saved_small):
    cfg, directory = saved_small
    ckpt = CheckpointDir(directory)
    specs = [ckpt.spec(n) for n in ckpt.names()]
    report = inspect_model(directory)
    acc = report.accounting
    assert report.source.endswith("config.json")
    assert acc.tree.parameters == counted_by_convention(specs)
    assert acc.tree.stored == sum(s.numel for s in specs if not s.name.endswith(".scale") or s.dtype != "F8_E8M0")
    for layer in range(cfg.n_layers):
        in_layer = [s for s in specs if s.name.startswith(f"layers.{layer}.")]
        assert acc.block(layer).parameters == counted_by_convention(in_layer)
    assert acc.base_block == base_block_by_formula(cfg)
    assert acc.layers.parameters == sum(g.parameters for g in acc.groups())
    assert [g.name for g in acc.groups()] == [g.name for g in seed_groups(acc.roles)]
    assert "blocks_text_only" not in acc.figures and "engram_gate" not in acc.figures


def test_command_line_on_a_checkpoint_directory(saved_small, tmp_path, capsys):
    cfg, directory = saved_small
    assert main([str(directory), "--json", "--html", str(tmp_path)]) == 0
    data = json.loads(capsys.readouterr().out)
    report = inspect_model(cfg)
    assert data["per_instance_total"] == report.accounting.layers.parameters
    pages = {p.name for p in tmp_path.iterdir()}
    assert "engram_gate.html" not in pages and "vision.html" not in pages and "compressor.html" in pages
    assert main([str(directory)]) == 0
    assert f"{report.accounting.layers.parameters:,}" in capsys.readouterr().out
    assert main([str(tmp_path / "missing.json")]) == 2


# ------------------------------------------------------------------------------ text, JSON, HTML
def test_text_output(report):
    text = render_text(report)
    assert "747,170,852,464" in text and "40,960" in text
    for name, value in SEED_GROUPS:
        assert any(line.startswith(name) and line.endswith(f"{value:,}") for line in text.splitlines())
    for value in ("747,170,837,104", "475,379,953,264", "748,494,684,784", "763,205,315,794", "484,619,644,114",
                  "23,561,606,160", "14,225,362,530", "411,842,560", "73,410,560"):
        assert value in text
    assert "[B batch, T positions, 4 streams, 5120 d]" in text


def test_json_output(report):
    data = json.loads(json.dumps(to_dict(report)))
    assert data["per_instance_total"] == SEED_TOTAL
    assert [(g["name"], g["parameters"]) for g in data["groups"]] == SEED_GROUPS
    assert data["engram_gate"] == {"1": 40_960, "14": 40_960}
    assert data["figures"]["blocks_text_only"]["value"] == 747_170_837_104
    assert data["tree"]["parameters"] == 763_205_315_794
    assert set(data["components"]) == ALL_KINDS
    gate = data["components"]["engram_gate"]
    assert gate["tables"][0]["total"] == 40_960 and gate["formulas"][0]["latex"].startswith("a_{k}")
    layer2 = next(c for c in data["tree"]["children"] if c["name"] == "layers")["children"][2]
    compressor = next(c for c in layer2["children"] if c["name"] == "compressor")
    assert compressor["module"] == "dsv41.model.compressor:Compressor" and compressor["parameters"] == 5_243_392


class _Collector(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.text = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def _read_page(path: Path) -> tuple[list, str]:
    parser = _Collector()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser.tags, " ".join(parser.text)


def test_html_pages(report, tmp_path):
    written = write_html(report, tmp_path)
    doc_pages = {docs.page_name(n) for n in docs.available()}
    assert {"doc-architecture.html", "doc-parameters.html"} <= doc_pages
    assert {p.name for p in written} == {"index.html"} | {f"{k}.html" for k in ALL_KINDS} | doc_pages
    ids = {p.name: {a["id"] for _, a in _read_page(p)[0] if "id" in a} for p in written}
    for page in written:
        tags, _ = _read_page(page)
        assert not any(t == "script" or "src" in a for t, a in tags)  # nothing to fetch when viewed
        links = [a["href"] for t, a in tags if t == "a"]
        for href in links:  # every link, section anchors included, resolves among the written pages
            target, _, anchor = href.partition("#")
            assert (tmp_path / target).is_file() and (not anchor or anchor in ids[target]), (page.name, href)
        if page.name not in doc_pages | {"index.html"}:
            assert any(t == "math" for t, _ in tags) and any(t == "mfrac" or t == "msub" for t, _ in tags)
    _, gate = _read_page(tmp_path / "engram_gate.html")
    assert "40,960" in gate and "20,480" in gate and "dsv41/model/engram/module.py" in gate
    assert "[B batch, T positions, 4 streams, 5120 d]" in gate
    for page in ("stack.html", "index.html"):
        _, text = _read_page(tmp_path / page)
        assert all(f"{v:,}" in text for _, v in SEED_GROUPS) and "747,170,852,464" in text
    _, compressor = _read_page(tmp_path / "compressor.html")
    assert "5,243,392" in compressor and "2,621,952" in compressor and "dsv41.model.compressor:Compressor" in compressor
    _, dspark = _read_page(tmp_path / "dspark_stage.html")
    assert "4,693,504,118" in dspark and "dsv41.model.dspark:DSparkStage" in dspark
    tags, _ = _read_page(tmp_path / "compressor.html")  # the specification is a link to its section
    assert {"href": "doc-architecture.html#s11.3"} in [a for t, a in tags if t == "a"]


class _Tables(HTMLParser):
    """Every table of a page as rows of cell texts."""

    def __init__(self):
        super().__init__()
        self.tables, self._cell = [], None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.tables[-1][-1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def _presence_column(index: Path) -> dict[str, str]:
    """Component title → its "In this configuration" cell on the index page."""
    parser = _Tables()
    parser.feed(index.read_text(encoding="utf-8"))
    table = next(t for t in parser.tables if t[0][:2] == ["Component", "In this configuration"])
    return {row[0]: row[1] for row in table[1:]}


def test_index_says_which_components_the_configuration_has(report, tmp_path):
    small = small_config()  # no Engram, no DSpark stages, no vision
    window_only = small.replace(compress_ratios=(0,) * small.n_layers, kv_source_layers=(), index_source_layers=(),
                                candidate_source_layer=None)  # and no compressed layers
    absent_small = {"engram", "engram_gate", "dspark_stage", "vision", "aligner"}
    absent_window = absent_small | {"compressor", "indexer", "candidate"}
    for name, r, absent in (("released", report, set()), ("small", inspect_model(small), absent_small),
                            ("window", inspect_model(window_only), absent_window)):
        write_html(r, tmp_path / name)
        column = _presence_column(tmp_path / name / "index.html")
        assert set(column) == {k.title for k in r.components.values()}
        for key, kind in r.components.items():
            assert column[kind.title].split(" — ")[0] == ("no" if key in absent else "yes"), (name, key)
            if key != "candidate":  # the one kind without parameters of its own: not in the tree
                assert bool(r.instances(key)) == (key not in absent), (name, key)
        assert (tmp_path / name / "engram.html").is_file() == ("engram" not in absent)
    released = _presence_column(tmp_path / "released" / "index.html")
    assert released["Engram"] == "yes — layers 1, 14" and released["DSpark stage"] == "yes — mtp.0–2"
    assert released["Compressor"] == "yes — layers 2, 8, 14, 20"
    assert released["Indexer"] == "yes — layers 2, 8, 14, 20, 24, 28, 32, 36"
    assert released["Candidate stage"] == "yes — source: layer 20"
    small_column = _presence_column(tmp_path / "small" / "index.html")
    assert small_column["Compressor"] == "yes — layers 2, 4" and small_column["Engram"] == "no"
    assert "Not in this configuration: Engram, Gate per stream, DSpark stage" in render_text(inspect_model(small))
    assert to_dict(inspect_model(window_only))["components"]["indexer"]["in_this_configuration"] == "no"


# ------------------------------------------------------------------------------ the documents cited
_REPO = Path(__file__).resolve().parents[1]


def test_every_docs_citation_names_a_section_that_exists():
    """A citation "docs/<name>.md §N" (or "… trap N", "… pitfall N") anywhere in the project resolves."""
    available = docs.available()
    anchors = {docs.page_name(n): set(re.findall(r'id="([^"]+)"', docs.render(p.read_text(encoding="utf-8"),
                                                                              available)))
               for n, p in available.items()}
    files = [p for pattern in ("dsv41/**/*.py", "tests/*.py", "*.md", "docs/*.md") for p in _REPO.glob(pattern)]
    checked = 0
    for path in files:
        text = path.read_text(encoding="utf-8")
        for name in re.findall(r"docs/([A-Z][A-Z-]*)\.md", text):
            assert name in available, f"{path.name} cites docs/{name}.md, which does not exist"
        for href in re.findall(r'href="([^"]+)"', docs.link_citations(text, available)):
            page, _, anchor = href.partition("#")
            assert not anchor or anchor in anchors[page], f"{path.name}: {href}"
            checked += 1
    assert checked > 100
    architecture = anchors["doc-architecture.html"]
    assert {f"trap-{n}" for n in range(1, 26)} <= architecture  # the numbered traps all keep their numbers
    assert {"s11.5", "s11.6", "s17", "s9-3"} <= architecture
    assert {f"s{n}" for n in range(1, 8)} <= anchors["doc-parameters.html"]


# ------------------------------------------------------------------------------ components, code, MathML
def test_where_it_lives(report):
    assert report.modules["layers.2.attn.compressor"] == "dsv41.model.compressor:Compressor"
    assert report.modules["layers.1.engram"] == "dsv41.model.engram.module:Engram"
    assert report.modules["layers.0.ffn.experts"] == "dsv41.model.moe:RoutedExperts"
    assert report.modules["mtp.0.attn"] == "dsv41.model.dspark:DSparkAttention"
    assert report.modules["vision"] == "dsv41.vision.encoder:ViT"
    assert report.modules["aligner"] == "dsv41.vision.encoder:Aligner"
    package_parent = Path(__file__).resolve().parents[1]
    for locations in report.code.values():
        for loc in locations:
            lines = (package_parent / loc.path).read_text().splitlines()
            assert 1 <= loc.first_line <= loc.last_line <= len(lines)
            assert loc.name.split(".")[-1] in lines[loc.first_line - 1]


def test_meta_build_holds_no_memory(report):
    model = build_meta_model(report.cfg)
    assert all(t.is_meta for t in model.state_dict(keep_vars=True).values())


def test_every_formula_converts_to_wellformed_mathml(report):
    for cfg in (report.cfg, small_config()):
        for kind in inspect_components(cfg).values():
            for f in kind.formulas:
                ET.fromstring(to_mathml(f.latex))


def inspect_components(cfg):
    from dsv41.inspect.components import describe_components
    return describe_components(cfg)


def test_mathml_text_keeps_the_spaces_at_its_edges(report):
    """Renderers drop whitespace at the edges of <mtext>: "or160000with YaRN". The edges are no-break spaces."""
    nbsp = "\u00a0"
    math_ml = ET.fromstring(to_mathml(r"a = 1 \text{ (r = 0) or } 2 \text{ with YaRN}"))
    texts = [e.text for e in math_ml.iter("{http://www.w3.org/1998/Math/MathML}mtext")]
    assert texts == [f"{nbsp}(r = 0) or{nbsp}", f"{nbsp}with YaRN"]
    for kind in report.components.values():
        for f in kind.formulas:
            for e in ET.fromstring(to_mathml(f.latex)).iter("{http://www.w3.org/1998/Math/MathML}mtext"):
                assert e.text and e.text == e.text.strip(" \t\n"), (kind.key, f.label, e.text)
    rotary = next(f for f in report.components["attention"].formulas if f.label == "rotary frequencies")
    assert f"or{nbsp}</mtext><mn>160000</mn><mtext>{nbsp}with YaRN" in to_mathml(rotary.latex)


def test_mathml_structure():
    math_ml = to_mathml(r"\frac{a}{\sqrt{b}} + \sum_{i} x_i^2")
    assert "<mfrac><mrow><mi>a</mi></mrow><mrow><msqrt><mrow><mi>b</mi></mrow></msqrt></mrow></mfrac>" in math_ml
    assert "<munder><mo" in math_ml and "<msubsup><mi>x</mi><mi>i</mi>" in math_ml
    assert 'mathvariant="normal">rms</mi>' in to_mathml(r"\operatorname{rms}(x)")
    with pytest.raises(MathMLError):
        to_mathml(r"\unknowncommand{x}")
    with pytest.raises(MathMLError):
        to_mathml(r"a}")

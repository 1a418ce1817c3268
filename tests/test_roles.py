"""Layer roles of the released config against the table of docs/ARCHITECTURE.md §3, and the seed document's
eight groups (docs/PARAMETERS.md §5 and §7: window layer, Engram, window layer, pooled group, Engram,
pooled group, token group, re-indexing group) including their parameter counts."""

import pytest
import torch

from dsv41.config import RuntimeConfig
from dsv41.model import Transformer
from dsv41.inspect.roles import roles_table, seed_groups
from dsv41.model.roles import POOLED, TOKEN, WINDOW, derive_roles

POOLED_SOURCES = {2: range(3, 8), 8: range(9, 14), 14: range(15, 20)}
REINDEXERS = (24, 28, 32, 36)


@pytest.fixture(scope="module")
def roles(released_cfg):
    return derive_roles(released_cfg)


def test_one_role_per_layer_including_dspark(roles):
    assert [r.layer_id for r in roles] == list(range(43))


def test_window_layers(roles):
    for layer in (0, 1):
        r = roles[layer]
        assert r.ratio == 0 and r.kind == WINDOW and not r.uses_compressed_rope
        assert r.kv_source is None and r.index_source is None
        assert not (r.is_kv_source or r.is_index_source or r.is_candidate_source) and r.candidate_source is None


def test_pooled_sources_and_their_consumers(roles):
    for source, consumers in POOLED_SOURCES.items():
        r = roles[source]
        assert r.ratio == 2 and r.kind == POOLED and r.uses_compressed_rope
        assert r.is_kv_source and r.is_index_source and r.kv_source == source and r.index_source == source
        assert not r.is_candidate_source and r.candidate_source is None
        for layer in consumers:
            c = roles[layer]
            assert c.ratio == 2 and not c.is_kv_source and not c.is_index_source
            assert c.kv_source == source and c.index_source == source and c.candidate_source is None


def test_token_source_is_the_candidate_source(roles):
    r = roles[20]
    assert r.ratio == 1 and r.kind == TOKEN
    assert r.is_kv_source and r.is_index_source and r.is_candidate_source
    assert r.kv_source == 20 and r.index_source == 20 and r.candidate_source is None
    for layer in (21, 22, 23):
        c = roles[layer]
        assert c.ratio == 1 and not c.is_index_source and c.kv_source == 20 and c.index_source == 20


def test_reindexing_layers_use_layer_20_keys_and_blocks(roles):
    for layer in REINDEXERS:
        r = roles[layer]
        assert r.ratio == 1 and r.is_index_source and not r.is_kv_source and not r.is_candidate_source
        assert r.kv_source == 20 and r.index_source == layer and r.candidate_source == 20
        for consumer in range(layer + 1, layer + 4):
            c = roles[consumer]
            assert c.ratio == 1 and not c.is_index_source and c.candidate_source is None
            assert c.kv_source == 20 and c.index_source == layer


def test_candidate_stage_has_exactly_one_source_and_four_users(roles):
    assert [r.layer_id for r in roles if r.is_candidate_source] == [20]
    assert [r.layer_id for r in roles if r.candidate_source is not None] == list(REINDEXERS)


def test_dspark_stages(roles):
    for layer in (40, 41, 42):
        r = roles[layer]
        assert r.is_dspark and r.ratio == 0 and not r.uses_compressed_rope
        assert not (r.is_kv_source or r.is_index_source or r.has_engram or r.is_dspark_target)
        assert r.kv_source is None and r.index_source is None
    assert [r.layer_id for r in roles if r.is_dspark] == [40, 41, 42]


def test_engram_and_dspark_targets(roles):
    assert [(r.layer_id, r.engram_index) for r in roles if r.has_engram] == [(1, 0), (14, 1)]
    assert [r.layer_id for r in roles if r.is_dspark_target] == [37, 38, 39]


def test_rope_table_choice(released_cfg):
    """Every r > 0 layer's attention rotates with θ = 160000 and YaRN; r = 0 layers (0, 1 and the DSpark
    stages) with the base θ and no YaRN (§3, trap 6): read from the modules of the released model."""
    from dsv41.model.rope import yarn_frequencies

    c = released_cfg
    compressed = yarn_frequencies(c.rope_head_dim, c.compress_rope_theta, c.original_seq_len, c.rope_factor,
                                  c.beta_fast, c.beta_slow)
    base = yarn_frequencies(c.rope_head_dim, c.rope_theta, 0, 1.0, 0.0, 0.0)
    model = Transformer(c, RuntimeConfig(max_seq_len=4096), device="meta")
    layers = list(model.layers) + list(model.mtp)
    uses_base = [i for i, layer in enumerate(layers) if torch.equal(layer.attn.rotary.freqs, base)]
    uses_compressed = [i for i, layer in enumerate(layers) if torch.equal(layer.attn.rotary.freqs, compressed)]
    assert uses_base == [0, 1, 40, 41, 42] and uses_compressed == list(range(2, 40))


def test_roles_table_rows(roles):
    lines = roles_table(roles).splitlines()
    first_cells = [line.split("|")[0].strip() for line in lines[2:]]
    assert first_cells[:6] == ["0", "1", "2", "3–7", "8", "9–13"]
    assert "20" in first_cells and "21–23" in first_cells and "40–42" in first_cells


def test_seed_groups_are_the_eight_rows_in_order(roles):
    groups = seed_groups(roles)
    got = [(g.name, g.layers, g.engram_layer) for g in groups]
    assert got == [
        ("Window layer", (0,), None),
        ("Engram", (), 1),
        ("Window layer", (1,), None),
        ("Pooled group", tuple(range(2, 14)), None),
        ("Engram", (), 14),
        ("Pooled group", tuple(range(14, 20)), None),
        ("Token group", (20, 21, 22, 23), None),
        ("Re-indexing group", tuple(range(24, 40)), None),
    ]


# Parameter counts of the seed document's eight rows: checkpoint element counts on the text path, fp4
# experts counted as out·in, quantisation scales excluded.
SEED_COUNTS = [13_754_511_990, 98_462_906_368, 13_754_511_990, 165_075_575_432, 98_465_597_952,
               82_537_787_716, 55_026_142_296, 220_093_818_720]
SEED_TOTAL = 747_170_852_464


def test_seed_group_parameter_counts(released_cfg, roles):
    model = Transformer(released_cfg, RuntimeConfig(max_seq_len=4096), device="meta")
    per_layer, per_engram = {}, {}
    for name, p in model.named_parameters():
        if not name.startswith("layers.") or name.endswith(".scale"):
            continue
        layer = int(name.split(".")[1])
        n = p.numel() * (2 if p.dtype.itemsize == 1 and ".experts." in name else 1)   # packed fp4: 2 per byte
        bucket = per_engram if ".engram." in name else per_layer
        bucket[layer] = bucket.get(layer, 0) + n
    counts = [per_engram[g.engram_layer] if g.engram_layer is not None else sum(per_layer[i] for i in g.layers)
              for g in seed_groups(roles)]
    assert counts == SEED_COUNTS
    assert sum(counts) == SEED_TOTAL

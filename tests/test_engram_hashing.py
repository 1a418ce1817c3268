"""Engram hash: layout, multipliers, public vectors, split invariance and the DEAD latch
(docs/ENGRAM-HASHING.md §2-§5)."""

import hashlib
import random

import numpy as np
import pytest
import torch

from dsv41.config import ModelConfig
from helpers import RELEASED_CONFIG
from dsv41.model.engram import (DEAD, VERIFIED_MULTIPLIERS, EngramHistory, EngramLayout, NgramHasher,
                          derive_multipliers, hash_compressed, is_prime)
from dsv41.model.engram.hashing import lookback_tokens

RELEASE = RELEASED_CONFIG  # ../shared/spec/config.json (DEVELOPING.md)
PAD = 2

# §2 table: primes per (layer, order), heads 0..7.
SPEC_PRIMES = {
    1: """16000057 16000079 16000081 16000097 16000121 16000129 16000133 16000183
          16000189 16000207 16000211 16000253 16000277 16000289 16000307 16000321
          16000339 16000381 16000393 16000399 16000403 16000409 16000447 16000463""",
    14: """16000477 16000487 16000499 16000507 16000511 16000573 16000609 16000627
           16000667 16000669 16000693 16000697 16000711 16000729 16000759 16000769
           16000781 16000799 16000813 16000819 16000841 16000877 16000879 16000889""",
}
SPEC_OFFSETS = {
    1: """0 16000057 32000136 48000217 64000314 80000435 96000564 112000697 128000880 144001069 160001276
          176001487 192001740 208002017 224002306 240002613 256002934 272003273 288003654 304004047
          320004446 336004849 352005258 368005705""",
    14: """0 16000477 32000964 48001463 64001970 80002481 96003054 112003663 128004290 144004957 160005626
           176006319 192007016 208007727 224008456 240009215 256009984 272010765 288011564 304012377
           320013196 336014037 352014914 368015793""",
}

# §5 T2 full rows (positions 0 and 1 are T1's), "pos L1" then "pos L14".
T2_ROWS = """
5702652 24393184 39183301 61503783 78984481 90144770 103724983 121476532 131476717 152385926 164143652 191599181 198145581 217419202 238329687 247482304 257520185 283540304 288689443 315264704 322314652 348890037 367865216 380066193
14361964 29977809 32716444 61209771 67456205 84275051 108494439 120604547 132225184 150270452 174805952 178895254 193207923 211610196 226280582 252505246 261362261 279862797 301364059 312864848 328367036 349372619 363873742 372375971
13136173 17031479 36294826 62401242 69561560 82615312 105142365 122730833 143666100 156931932 165213353 180168542 197858374 222703855 235972003 240958518 270063682 283921719 297024305 319576009 329277020 351828750 355986352 378790237
7976312 25015455 32662253 59094253 72310297 85156133 108102275 119576138 131069797 145343601 172623612 185170695 205084594 221545257 227646200 251014423 260231155 280143022 290296486 312934632 326604373 350427914 363307643 379703671
11893233 24906283 36271404 63193552 71581548 85045614 107778028 119944892 138046840 144354349 167090083 181822332 206249197 210464723 232791091 248380556 269065729 276273278 292050166 315939507 326532456 350422363 363062610 373441560
2482854 24703628 44969718 53147761 65237280 84640229 97472792 127894937 136842538 150890911 175468558 187565751 205906169 220346377 239087134 245336083 270602670 284958579 296126288 316913802 334467789 347200978 364798532 372782447
6360711 25957575 32110270 49376692 75426421 84149688 96518890 123554951 138276054 152324037 171459790 188685086 207918962 217603496 232214789 243649226 258440771 277348333 303423812 308478257 327854546 348928174 365319782 379093726
13904262 26847797 42416855 52818539 74026584 91311903 107001919 114982449 139636779 149526400 172284718 176093363 197459053 222723618 227696652 245410769 257104004 282719433 288481982 318398321 332172428 336092419 362099967 380148274
973519 27405357 32686984 51484894 76165053 86653983 109322749 120788598 143713325 146021439 166923517 187718516 200886908 220289396 233415376 249806210 269040586 276868153 296046228 316840026 331889434 340243451 352094293 383562570
14746523 24832352 37464264 60752002 73655711 85054239 100137950 125190883 135196387 159535536 163970573 186316853 207140219 219315568 224067043 252150227 258423491 282759728 302779271 319080346 325682004 344739652 362016150 371543825
13131409 22107638 46286683 48259159 69021570 87090089 104214597 115341818 135668340 153487008 173618607 188767007 202799274 218658354 227500189 247695875 263305423 286673806 301468933 317076885 322226568 338068066 366983032 374944357
3275938 25911066 45539186 51149320 70912410 90856326 98488218 121693602 138179889 150043220 160849163 188886169 196040196 212160697 225094758 242721678 265329153 287368882 299225659 318130311 330399774 345584920 362167745 383472364
10635489 23985305 39744525 53818166 66930043 81967808 97486831 123477372 133503831 147890110 175423203 179404797 206010704 217325771 233813515 251094404 258539094 286313701 303365463 313410700 326003715 337737122 366235366 376915334
11305274 27334783 40171751 59397793 69011134 82040608 104597715 123883017 129105832 156083983 167275007 191814591 200714998 209907297 237124659 250983343 270238326 286299254 291654597 311372497 332301086 343286957 363465529 369775045
12468576 16718146 43286524 63833232 78655309 88929935 110067485 118290632 132331405 150032068 175299614 184615383 192232518 220043721 237762882 246213312 264642624 275379885 303858648 313190107 325889830 338657139 366053543 370325977
15555572 31500739 47435118 63391705 79370304 95035333 110844638 126750585 131804218 150894767 171975754 178156586 199790744 211608223 225977525 241436435 256579389 282261820 297003912 304872737 332085268 350275878 366161436 369421411
"""
T2_IDS = [0, 3, 17, 523, 99091, 42, 7, 7]
T2_LOOKBACK = [[0, 2, 2, 2], [3, 0, 2, 2], [17, 3, 0, 2], [523, 17, 3, 0], [99091, 523, 17, 3],
               [42, 99091, 523, 17], [7, 42, 99091, 523], [7, 7, 42, 99091]]
T1_DIGEST = "f5a64799492bea90bc6d87f0cb8a67bb983441e1cd9c12ec2e7b8df6cbcfee1d"
T1_L1_DIGEST = "8e0187ea859a7db65517a540eb5210457ec907fd0b2f44042d830366cbedbda5"
T1_L14_DIGEST = "33e046238287e6e8b7c3466bdb4b7b47182ad19f9115afac8a1983ede219ba80"
T2_DIGEST = "16c7a4bbaddcd8c2d2dad6041edcdbcbf4ee994c5ea5f829c90f7f103bfd3bbe"


def ints(text):
    return [int(v) for v in text.split()]


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(np.ascontiguousarray(t.numpy()).astype("<i8").tobytes()).hexdigest()


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.from_json(RELEASE)


@pytest.fixture(scope="module")
def layout(cfg):
    return EngramLayout.from_config(cfg)


def run_hash(layout, ids, start_pos=0, history=None, mask=None):
    ids = torch.as_tensor(ids, dtype=torch.int64)
    history = history if history is not None else EngramHistory.create(ids.shape[0], 64)
    return hash_compressed(layout, ids, start_pos, history, PAD, mask)


# ---------------------------------------------------------------- layout and multipliers --------


def test_released_primes_offsets_rows(layout):
    assert layout.layer_ids == (1, 14) and layout.n_columns == 24
    for e, layer in enumerate((1, 14)):
        assert list(layout.primes[e]) == ints(SPEC_PRIMES[layer])
        assert list(layout.offsets[e]) == ints(SPEC_OFFSETS[layer])
        assert layout.offsets[e][-1] + layout.primes[e][-1] == layout.num_embeddings[e]
    assert layout.num_embeddings == (384006168, 384016682)
    # "the first 48 primes above 16,000,000, handed out in order"
    expected, n = [], 16_000_000
    while len(expected) < 48:
        n += 1
        if all(n % d for d in range(2, int(n**0.5) + 1)):
            expected.append(n)
    assert [p for e in range(2) for p in layout.primes[e]] == expected


def test_num_embeddings_mismatch_is_an_error(cfg):
    bad = cfg.replace(engram_num_embeddings=(384006168, 384016683))
    with pytest.raises(ValueError, match="384016683"):
        EngramLayout.from_config(bad)


def test_prime_search_small_config(cfg):
    # A shared used-set and a restart at vocab - 1 for every order: the primes above 100 in order.
    small = cfg.replace(engram_layer_ids=(0, 2), engram_vocab_size=101, engram_n_heads=2,
                        engram_max_ngram_size=3, engram_num_embeddings=(101 + 103 + 107 + 109, 113 + 127 + 131 + 137))
    lay = EngramLayout.from_config(small)
    assert lay.primes == ((101, 103, 107, 109), (113, 127, 131, 137))
    assert lay.offsets == ((0, 101, 204, 311), (0, 113, 240, 371))
    assert lay.multipliers[0] == derive_multipliers(0, small.engram_compressed_vocab_size, 3)
    ids, mask = random_rows(random.Random(3), 2, 11, dead_rate=0.2)
    out = run_hash(lay, ids, mask=torch.tensor(mask))
    assert out.shape == (2, 11, 2, 4)
    assert out.tolist() == slow_hash(lay, [[c if m else DEAD for c, m in zip(r, mr)] for r, mr in zip(ids, mask)])


def test_is_prime_against_sieve():
    n = 20000
    sieve = np.ones(n, dtype=bool)
    sieve[:2] = False
    for i in range(2, int(n**0.5) + 1):
        sieve[i * i::i] = False
    assert [is_prime(i) for i in range(n)] == sieve.tolist()
    assert is_prime(2**61 - 1) and not is_prime(3215031751)  # a strong pseudoprime to bases 2, 3, 5, 7


def test_multiplier_derivation_matches_verified_constants(layout):
    bound = max(1, ((2**63 - 1) // 99092) // 2)
    assert bound == 46_539_438_283_891
    for layer in (1, 14):
        derived = derive_multipliers(layer, 99092, 4)
        assert derived == VERIFIED_MULTIPLIERS[(99092, layer)]
        assert all(isinstance(m, int) and m % 2 == 1 and m < 2 * bound + 1 for m in derived)
    assert layout.multipliers == (VERIFIED_MULTIPLIERS[(99092, 1)], VERIFIED_MULTIPLIERS[(99092, 14)])


def test_products_do_not_overflow_int64(layout):
    _, _, mults = layout.tensors()
    bound = ((2**63 - 1) // 99092) // 2
    largest_possible = 99091 * (2 * (bound - 1) + 1)  # largest id times the largest multiplier
    assert 9.2e18 < largest_possible < 2**63 - 1  # the §3 headroom is genuinely thin
    got = torch.tensor(99091, dtype=torch.int64) * mults
    assert got.tolist() == [[99091 * m for m in row] for row in layout.multipliers]
    assert (got > 0).all()


# ---------------------------------------------------------------- public vectors (§5) -----------


def test_t1_vector(layout):
    out = run_hash(layout, [[0, 3]])
    assert out.shape == (1, 2, 2, 24) and out.dtype == torch.int64
    rows = [ints(r) for r in T2_ROWS.strip().splitlines()]
    assert out[0].reshape(4, 24).tolist() == rows[:4]
    assert digest(out) == T1_DIGEST
    assert digest(out[:, :, 0]) == T1_L1_DIGEST
    assert digest(out[:, :, 1]) == T1_L14_DIGEST


def test_t2_vector_rows_digest_and_lookback(layout):
    history = EngramHistory.create(1, 16)
    out = run_hash(layout, [T2_IDS], history=history)
    rows = [ints(r) for r in T2_ROWS.strip().splitlines()]
    assert out[0].reshape(16, 24).tolist() == rows
    assert digest(out) == T2_DIGEST
    assert lookback_tokens(history, torch.zeros(8, dtype=torch.long), torch.arange(8), PAD, 4).tolist() == T2_LOOKBACK


def test_t2_prefill_then_single_steps(layout):
    history = EngramHistory.create(1, 16)
    parts = [run_hash(layout, [T2_IDS[:3]], 0, history)]
    parts += [run_hash(layout, [[T2_IDS[p]]], p, history) for p in range(3, 8)]
    assert digest(torch.cat(parts, dim=1)) == T2_DIGEST


# ---------------------------------------------------------------- slow §4 oracle ----------------


def slow_hash(layout, rows, pad=PAD):
    """Per-position Python-int evaluation of §4; rows: lists of compressed ids, DEAD for image positions."""
    K, heads = layout.max_ngram_size, layout.n_heads
    out = []
    for seq in rows:
        per_pos = []
        for p in range(len(seq)):
            toks, blocked = [], False
            for k in range(K):
                src = seq[max(p - k, 0)]
                blocked = blocked or p < k or src == DEAD
                toks.append(pad if blocked else src)
            per_layer = []
            for e in range(layout.n_layers):
                prods = [t * m for t, m in zip(toks, layout.multipliers[e])]
                cols, rolling = [], prods[0]
                for n in range(2, K + 1):
                    rolling ^= prods[n - 1]
                    for h in range(heads):
                        c = (n - 2) * heads + h
                        cols.append(rolling % layout.primes[e][c] + layout.offsets[e][c])
                per_layer.append(cols)
            per_pos.append(per_layer)
        out.append(per_pos)
    return out


def random_rows(rng, B, T, dead_rate):
    ids = [[rng.randrange(99092) for _ in range(T)] for _ in range(B)]
    mask = [[rng.random() >= dead_rate for _ in range(T)] for _ in range(B)]
    return ids, mask


def test_dead_position_latches_and_blocks_ngrams(layout):
    ids = [[5, 6, 7, 8, 9, 10, 11, 12]]
    mask = torch.ones(1, 8, dtype=torch.bool)
    mask[0, 3] = False
    history = EngramHistory.create(1, 8)
    out = run_hash(layout, ids, history=history, mask=mask)
    assert history.ids[0].tolist() == [5, 6, 7, DEAD, 9, 10, 11, 12]
    tok = lookback_tokens(history, torch.zeros(8, dtype=torch.long), torch.arange(8), PAD, 4).tolist()
    assert tok[3] == [PAD] * 4  # the DEAD position itself hashes as all-pad
    assert tok[4] == [9, PAD, PAD, PAD]  # look-back stops at the DEAD position ...
    assert tok[5] == [10, 9, PAD, PAD]
    assert tok[6] == [11, 10, 9, PAD]  # ... and, latched, never reaches 7, 6 or 5 beyond it
    assert tok[7] == [12, 11, 10, 9]
    expected = slow_hash(layout, [[5, 6, 7, DEAD, 9, 10, 11, 12]])
    assert out.tolist() == expected
    # Position 4 hashes like a sequence start: [9, pad, ...] is position 0 of a sequence "9 ...".
    fresh = run_hash(layout, [[9]])
    assert torch.equal(out[:, 4], fresh[:, 0])


def test_hash_matches_slow_oracle_with_masks(layout):
    rng = random.Random(0)
    ids, mask = random_rows(rng, 3, 29, dead_rate=0.2)
    out = run_hash(layout, ids, mask=torch.tensor(mask))
    seqs = [[c if m else DEAD for c, m in zip(r, mr)] for r, mr in zip(ids, mask)]
    assert out.tolist() == slow_hash(layout, seqs)


def test_token_hasher_split_invariance(layout):
    gen = torch.Generator().manual_seed(1)
    # A raw vocabulary of 129,280 ids onto 99,092 compressed ids (every compressed id used).
    token_map = torch.cat([torch.arange(99092), torch.randint(0, 99092, (129280 - 99092,), generator=gen)])
    token_map[2] = 2
    hasher = NgramHasher(layout, token_map)
    B, T = 3, 37
    tokens = torch.randint(0, 129280, (B, T), generator=gen)
    mask = torch.rand(B, T, generator=gen) > 0.15
    whole = hasher(tokens, 0, EngramHistory.create(B, 48), mask)
    expected = slow_hash(layout, [[int(token_map[t]) if m else DEAD for t, m in zip(r, mr)]
                                  for r, mr in zip(tokens.tolist(), mask.tolist())])
    assert whole.tolist() == expected
    rng = random.Random(2)
    for _ in range(4):
        cuts = sorted(rng.sample(range(1, T), rng.randrange(1, 8)))
        history, parts = EngramHistory.create(B, 48), []
        for a, b in zip([0] + cuts, cuts + [T]):
            parts.append(hasher(tokens[:, a:b], a, history, mask[:, a:b]))
        assert torch.equal(torch.cat(parts, dim=1), whole)
    history = EngramHistory.create(B, 48)
    steps = [hasher(tokens[:, p:p + 1], p, history, mask[:, p:p + 1]) for p in range(T)]
    assert torch.equal(torch.cat(steps, dim=1), whole)


def test_stale_history_is_overwritten_before_use(layout):
    # A reused history (previous prompt, rejected drafts) needs no reset: positions <= p are rewritten.
    history = EngramHistory.create(1, 16)
    run_hash(layout, [[9, 9, 9, 9, 9, 9, 9, 9]], 0, history, torch.tensor([[True, False] * 4]))
    again = run_hash(layout, [T2_IDS[:5]], 0, history)
    again = torch.cat([again, run_hash(layout, [T2_IDS[5:]], 5, history)], dim=1)
    assert digest(again) == T2_DIGEST


def test_pad_comes_through_the_token_map(layout):
    # The hash pads with map[engram_pad_id], not with the raw pad id.
    token_map = torch.arange(99092).roll(1)  # map[2] = 1
    hasher = NgramHasher(layout, token_map)
    assert hasher.pad == 1
    tok = torch.tensor([[4]])
    got = hasher(tok, 0, EngramHistory.create(1, 4))
    assert got.tolist() == slow_hash(layout, [[3]], pad=1)


# ---------------------------------------------------------------- state and errors --------------


def test_history_rows_copy_and_reset(layout):
    history = EngramHistory.create(4, 16)
    view = history.rows(1, 2)
    run_hash(layout, [T2_IDS, T2_IDS[::-1]], 0, view)
    assert history.ids[1, :8].tolist() == T2_IDS and history.ids[2, :8].tolist() == T2_IDS[::-1]
    assert (history.ids[0] == DEAD).all() and (history.ids[3] == DEAD).all()
    history.copy_rows(3, history, 1)
    assert torch.equal(history.ids[3], history.ids[1])
    history.reset_rows([1, 3])
    assert (history.ids[1] == DEAD).all() and (history.ids[3] == DEAD).all()
    # A batch smaller than the history uses its first rows.
    out = run_hash(layout, [T2_IDS], 0, history)
    assert digest(out) == T2_DIGEST


def test_positions_beyond_history_are_an_error(layout):
    history = EngramHistory.create(2, 8)
    with pytest.raises(ValueError, match="history length 8"):
        run_hash(layout, [[1, 2, 3], [4, 5, 6]], 6, history)
    with pytest.raises(ValueError, match="batch 3"):
        run_hash(layout, [[1], [2], [3]], 0, history)


def test_token_map_size_must_match(layout):
    with pytest.raises(ValueError, match="99092"):
        NgramHasher(layout, torch.arange(99091))

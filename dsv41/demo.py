"""The built-in demo models: a trained one shipped with the package, and a random-weight one made on demand.

The trained demo (`dsv41/demo_model/`, the default model of every command) is a 4.9M-parameter
V4.1-architecture model trained on Shakespeare by `tools/train_demo.py` (docs/TRAINING.md §7). The
random demo below is what the test suite and the benchmarks run: its choices bind and tie everywhere.
`DSV41_DEMO=random` makes it the commands' default.

The random demo: a small DeepSeek-V4.1-architecture checkpoint with random weights.

It covers every layer role of the release (window layers, ratio-2 and ratio-1 kv sources and their
consumers, index sources, the candidate source and a candidate user, two Engram layers, 4 streams, MoE
with fp4 experts and fp8 dense weights, two DSpark stages) and a byte-level BPE tokenizer trained with `tokenizers` on a
built-in text, with the release's special tokens (BOS 0, EOS 1, pad 2). It is created deterministically
on first use, written through the real writer in the released layout into a user cache directory, and
then loaded through the real loader, so the demo takes exactly the path a released checkpoint takes.
Its weights are random: its text is not language.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .chat import encoding
from .errors import UserError
from .tokenizer import SPECIAL_TOKENS, save_tokenizer, train_bpe

DEMO_NAME = "demo-v4"
DEMO_SEED = 20261129
DEMO_VOCAB = 1024
_CORPUS = """\
DeepSeek-V4.1 carries its residual stream as four parallel streams. Each block reads the streams with a
learned mix, runs attention or a mixture of experts, and writes back through a doubly stochastic matrix
made by Sinkhorn iterations. Attention keeps one shared key and value latent of 512 features per token.
Every layer sees a sliding window of the last 128 tokens; pooled layers also see compressed positions
that stand for two tokens each, token layers one compressed position per token. An indexer chooses the
best 512 compressed positions for every query, and from layer 24 on the choice is restricted to the
candidate blocks layer 20 picked. Engram adds an n-gram memory read before layers 1 and 14: the last
four tokens are hashed into 24 rows of a large table, projected into one key per stream and a shared
value, and gated by how well each stream matches its key. The draft blocks of DSpark propose five tokens
at a time, and the target model verifies them in one pass, so the output distribution stays the same.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2048 65536. Code: def f(x): return x * 2 + 1  # comment
The quick brown fox jumps over the lazy dog. Hello, world! How are you today? I am fine, thank you.
User: what is the capital of France? Assistant: Paris is the capital of France.
"""


def demo_config_dict(vocab_size: int, compressed_vocab_size: int) -> dict:
    """The demo's config.json (inference/config.json keys), every layer role present."""
    from .model.engram.hashing import table_rows

    base = dict(
        vocab_size=vocab_size, dim=128, moe_inter_dim=64, n_layers=8, n_mtp_layers=2, n_heads=8,
        n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, score_func="sqrtsoftplus",
        route_scale=1.5, swiglu_limit=10.0, q_lora_rank=64, head_dim=64, rope_head_dim=16, norm_eps=1e-20,
        o_groups=4, o_lora_rank=32, window_size=16,
        compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1, 0, 0], kv_source_layers=[2, 4], index_source_layers=[2, 4, 6],
        original_seq_len=256, rope_theta=10000, rope_factor=16, beta_fast=32, beta_slow=1,
        index_n_heads=4, index_head_dim=32, index_topk=16, candidate_source_layer=4, candidate_topk_blocks=4,
        candidate_block_size=4, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        engram_layer_ids=[1, 3], engram_vocab_size=2000, engram_max_ngram_size=4, engram_pad_id=2,
        engram_compressed_vocab_size=compressed_vocab_size, engram_n_heads=2, engram_head_dim=32,
        dtype="fp8", expert_dtype="fp4", compress_rope_theta=160000,
        # two DSpark stages drafting 5 rows from the streams entering layers 5–7; the noise token is
        # <｜System｜>, as in the release
        dspark_block_size=5, dspark_noise_token_id=SPECIAL_TOKENS.index(encoding.SYSTEM),
        dspark_target_layer_ids=[5, 6, 7], dspark_markov_rank=32, dspark_n_routed_experts=4,
        dspark_n_activated_experts=2,
        **demo_vision(SPECIAL_TOKENS.index(encoding.IMAGE_PLACEHOLDER)),
    )
    base["engram_num_embeddings"] = list(table_rows(len(base["engram_layer_ids"]), base["engram_max_ngram_size"],
                                                    base["engram_n_heads"], base["engram_vocab_size"]))
    return base


def demo_vision(image_token_id: int) -> dict:
    """The demo's vision tower: a 2-block ViT of width 64 (4 heads of 16); an image costs at most 64
    positions, and a square one, planned at 126 × 126 pixels (9 × 9 patches, 3 × 3 cells), 14."""
    return dict(vision_n_layers=2, vision_dim=64, vision_n_heads=4, vision_inter_dim=128, vision_patch_size=14,
                vision_downsample_ratio=3, vision_max_n_token=64, vision_min_pixels=126 * 126,
                vision_max_wh_ratio=None, vision_rope_theta=10000.0, image_token_id=image_token_id)


def attach_vision_tower(directory: Path, seed: int) -> Path:
    """Give a text-only checkpoint the demo's vision tower, with random weights (`init_random_` at
    `seed`: the ViT, the aligner, the span delimiters and every router's `bias_vl`), rewriting it
    through the real writer; the text weights are copied unchanged."""
    import torch

    from .checkpoint.model_io import load_model, save_model
    from .config import RuntimeConfig
    from .model import Transformer
    from .model.init import init_random_
    from .tokenizer import Tokenizer

    directory = Path(directory)
    text = load_model(directory, RuntimeConfig(max_seq_len=256), check_memory=False, progress=False)
    if text.cfg.vision_enabled:
        raise UserError(f"{directory} already has a vision tower")
    tokenizer = Tokenizer.from_dir(directory)
    cfg = text.cfg.replace(**demo_vision(tokenizer.token_to_id(encoding.IMAGE_PLACEHOLDER)))
    with torch.no_grad():
        model = init_random_(Transformer(cfg, text.runtime), seed)
        missing, unexpected = model.load_state_dict(text.state_dict(), strict=False)
    if unexpected or any(not n.startswith(("vision.", "aligner.", "image_")) and not n.endswith("bias_vl")
                         for n in missing):
        raise UserError(f"{directory}: the text weights do not fit the vision build ({unexpected or missing})")
    staging = Path(tempfile.mkdtemp(prefix=".vision-", dir=directory.parent))
    try:
        save_model(model, staging, tokenizer=directory, max_shard_bytes=8 << 20)
        for old in directory.glob("model*.safetensors*"):
            old.unlink()
        for new in staging.iterdir():
            shutil.move(str(new), directory / new.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def train_tokenizer():
    """A byte-level BPE (at most DEMO_VOCAB tokens: the corpus is small) with the release's pre-tokenizer
    and special tokens."""
    return train_bpe([_CORPUS] * 4, DEMO_VOCAB)


def cache_root() -> Path:
    """Where the demo lives: $DSV41_CACHE, else $XDG_CACHE_HOME/dsv41, else ~/.cache/dsv41."""
    if os.environ.get("DSV41_CACHE"):
        return Path(os.environ["DSV41_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dsv41"


def create_demo_checkpoint(directory: Path) -> Path:
    """Build the demo (tokenizer, config, random weights) and write it in the released layout."""
    import torch

    from .checkpoint.model_io import save_model
    from .config import ModelConfig, RuntimeConfig
    from .model.engram import build_token_map
    from .model.init import init_random_
    from .model import Transformer

    tokenizer = train_tokenizer()
    token_map = build_token_map(tokenizer)
    cfg = ModelConfig.from_dict(demo_config_dict(tokenizer.get_vocab_size(), int(token_map.max()) + 1))
    with torch.no_grad():
        model = init_random_(Transformer(cfg, RuntimeConfig(max_seq_len=256)), DEMO_SEED)
    directory.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tokenizer, directory)
    save_model(model, directory, max_shard_bytes=4 << 20)
    (directory / "DEMO.md").write_text("Random-weight DeepSeek-V4.1-architecture demo made by dsv41. Its text is not language.\n")
    return directory


def ensure_demo_checkpoint() -> Path:
    """The demo directory, created on first use (atomically: a half-written demo is never used)."""
    target = cache_root() / DEMO_NAME
    if (target / "model.safetensors.index.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}-", dir=target.parent))
    try:
        create_demo_checkpoint(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "model.safetensors.index.json").is_file():
                raise                                     # not a concurrent creator winning the race
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


TRAINED_DEMO = Path(__file__).resolve().parent / "demo_model"
DEMO_CHOICES = ("trained", "random")


def default_checkpoint() -> tuple[Path, str]:
    """(the commands' default checkpoint, a note saying which it is): the trained demo, or with
    DSV41_DEMO=random the random-weight demo."""
    choice = os.environ.get("DSV41_DEMO", "trained")
    if choice not in DEMO_CHOICES:
        raise UserError(f"DSV41_DEMO={choice!r}: expected one of {', '.join(DEMO_CHOICES)}")
    if choice == "random":
        path = ensure_demo_checkpoint()
        return path, f"using the random-weight demo model at {path}; its text is not language"
    if not (TRAINED_DEMO / "model.safetensors.index.json").is_file():
        raise UserError(f"the trained demo is missing from this installation ({TRAINED_DEMO}); reinstall dsv41, "
                        f"or set DSV41_DEMO=random for the random-weight demo")
    return TRAINED_DEMO, ("using the built-in demo: a 4.9M-parameter DeepSeek-V4.1-architecture model trained on "
                          "Shakespeare (docs/TRAINING.md)")

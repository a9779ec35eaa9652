"""Sample text from a trained checkpoint.

    pe-generate ckpt_path=<run>/checkpoints/last.ckpt prompt="ROMEO:" max_new_tokens=200 \\
        temperature=0.8 top_k=40 top_p=0.95 num_samples=3 seed=0
    pe-generate ckpt_path=... prompt="ROMEO:" temperature=0           # greedy
    pe-generate ckpt_path=... max_new_tokens=600 context=full          # read the whole text (extrapolation)
    pe-generate ckpt_path=<encoder run>/checkpoints/last.ckpt prompt="ROMEO: <mask> me, I pray"
    pe-generate ckpt_path=<rope run> context=full pe.scaling=yarn pe.scaling_factor=4   # RoPE scaled at inference

The model and its tokenizer are rebuilt from the checkpoint's own config by ``training.run_loader.load_trained_run``
(options in configs/generate.yaml); a run folder works as ckpt_path too (its checkpoints/last.ckpt).
"""

from __future__ import annotations

import math
import sys
import time

import hydra
from omegaconf import DictConfig, OmegaConf

import pe_geometry.offline  # noqa: F401  (the offline environment, before anything that could download)
from pe_geometry.configs import CONFIG_DIR

CONFIG_PATH = CONFIG_DIR / "generate.yaml"


class GenerateError(ValueError):
    """Bad input to generate.py: reported as one ``error:`` line."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:  # nan and inf are not settings: nan > 0 is False, so they would pass a range check
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def options() -> list[str]:
    """The keys configs/generate.yaml gives pe-generate."""
    return sorted(set(OmegaConf.load(CONFIG_PATH)) - {"defaults", "hydra"})


def unknown_key_line(key: str, known: list[str]) -> str:
    """One line for a key pe-generate has not: the closest option first, then every one."""
    import difflib

    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"{key} is not an option of pe-generate{hint} (options: {', '.join(known)})"


def check_keys(cfg: DictConfig) -> None:
    """Every key is one configs/generate.yaml has: ``+tempreture=0.5`` (a typo Hydra's ``+`` adds) would otherwise
    sample at the default temperature without a word."""
    known = options()
    for key in (k for k in cfg if k not in known and k not in ("hydra", "defaults")):
        raise GenerateError(unknown_key_line(str(key), known))


def check_options(cfg: DictConfig) -> None:
    for key in ("max_new_tokens", "num_samples", "seed"):
        if not _is_int(cfg[key]):
            raise GenerateError(f"{key}={cfg[key]!r} must be an integer")
    for key in ("temperature", "top_p"):
        if cfg[key] is not None and not _is_number(cfg[key]):
            raise GenerateError(f"{key}={cfg[key]!r} must be a finite number")
    if cfg.top_k is not None and not _is_int(cfg.top_k):
        raise GenerateError(f"top_k={cfg.top_k!r} must be an integer >= 0 or null")
    if not isinstance(cfg.use_cache, bool):
        raise GenerateError(f"use_cache={cfg.use_cache!r}; valid: true, false")
    if cfg.seed < 0:
        raise GenerateError(f"seed={cfg.seed} must be >= 0")
    if cfg.max_new_tokens < 0:
        raise GenerateError(f"max_new_tokens={cfg.max_new_tokens} must be >= 0")
    if cfg.num_samples < 1:
        raise GenerateError(f"num_samples={cfg.num_samples} must be >= 1")
    if cfg.temperature < 0:
        raise GenerateError(f"temperature={cfg.temperature} must be >= 0 (0 = greedy)")
    if cfg.top_k is not None and cfg.top_k < 0:
        raise GenerateError(f"top_k={cfg.top_k} must be >= 0 (0 or null = no top-k filter)")
    if cfg.top_p is not None and not 0 < cfg.top_p <= 1:
        raise GenerateError(f"top_p={cfg.top_p} must be in (0, 1] (1 or null = no nucleus filter)")
    resolve_context(cfg.context, seq_len=1)  # a bad value fails before the checkpoint loads


def unscaled_line(model) -> str | None:
    """A warning when a RoPE scaling is asked for at factor 1, which changes no frequency (``pe.scaling=llama3`` alone
    reads as RoPE itself, silently): as pe-train says at start."""
    for module in model.modules():
        settings = getattr(module, "settings", None)
        scaling = getattr(settings, "scaling", "none")
        if scaling in ("linear", "ntk", "yarn", "llama3") and getattr(settings, "scaling_factor", None) == 1:
            return (f"warning: pe.scaling={scaling} at pe.scaling_factor=1 changes no frequency: the text is RoPE's own; "
                    "set pe.scaling_factor > 1 (how many times the training length)")
    return None


CONTEXT_CHOICES = "train (the training length, default), full (the whole text), or a number of tokens >= 1"


def resolve_context(value: object, seq_len: int) -> int | None:
    """``context=`` -> the number of tokens each new one is drawn from (None: all of them)."""
    if value == "train":
        return seq_len
    if value == "full":
        return None
    if _is_int(value) and value >= 1:
        return value
    raise GenerateError(f"context={value!r}; valid: {CONTEXT_CHOICES}")


def context_line(context: int | None, seq_len: int, text_len: int) -> str | None:
    """One line telling the user how far the model reads, when that matters for this text (else None)."""
    if context is None and text_len > seq_len:
        return (
            f"context=full: the model was trained on {seq_len} tokens and reads all {text_len} here "
            f"(positions past {seq_len} are extrapolation)"
        )
    if context is not None and text_len > context:
        setting = "context=train" if context == seq_len else f"context={context}"
        trained = "the training length" if context == seq_len else f"the model was trained on {seq_len}"
        return f"{setting}: each token is drawn from the last {context} tokens ({trained}); context=full reads the whole text"
    return None


def pick_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch.empty(0, device=name)
    except (RuntimeError, AssertionError) as err:
        raise GenerateError(f"device={name} is not usable here ({err}); valid: auto, cpu, cuda, cuda:N, mps") from None
    return name


def run(cfg: DictConfig) -> list[str]:
    """Generate ``cfg.num_samples`` texts as the command line asks; returns them."""
    check_keys(cfg)  # before torch loads: a bad option is refused in a fraction of a second
    check_options(cfg)
    import torch

    from pe_geometry.model import EncoderMLM
    from pe_geometry.model.sampling import fill_masks, generate, prompt_ids
    from pe_geometry.training.run_loader import load_trained_run
    from pe_geometry.training.threads import use_idle_cores

    use_idle_cores()  # the cores idle now, as pe-train (OMP_NUM_THREADS=N to choose)
    device = pick_device(cfg.device)
    loaded = load_trained_run(cfg.ckpt_path, device, pe_overrides=OmegaConf.to_container(cfg.get("pe") or {}))
    model, tokenizer = loaded.model, loaded.tokenizer
    text = str(cfg.prompt).replace("\\n", "\n")
    ids = prompt_ids(model, tokenizer.encode(text).ids, tokenizer.token_to_id("<eos>"))
    seq_len = int(loaded.config.data.seq_len)
    context = resolve_context(cfg.context, seq_len)
    text_len = len(ids) + (0 if isinstance(model, EncoderMLM) else cfg.max_new_tokens - 1)
    if line := context_line(context, seq_len, text_len):
        print(line, file=sys.stderr)
    if line := unscaled_line(model):
        print(line, file=sys.stderr)
    if loaded.config.get("pe", {}).get("shuffle"):
        print("note: this run was trained with pe.shuffle=true (a control: every forward reads the position rows in a "
              "random order), so its text differs from call to call and with use_cache", file=sys.stderr)
    batch = torch.tensor([ids] * cfg.num_samples, device=device)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    sampling = {"temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p, "generator": generator}
    started = time.perf_counter()
    has_blanks = tokenizer.token_to_id("<mask>") in ids
    if isinstance(model, EncoderMLM):
        if not has_blanks:
            raise GenerateError(f"prompt={cfg.prompt!r}: a masked-LM encoder fills blanks; mark them with <mask>")
        out = fill_masks(model, batch, context=context, **sampling)
        new_tokens = int((batch == model.mask_token_id).sum())
    else:
        if has_blanks:
            raise GenerateError(f"prompt={cfg.prompt!r} holds <mask>, but only a masked-LM encoder fills blanks")
        out = generate(model, batch, cfg.max_new_tokens, use_cache=cfg.use_cache, context=context, **sampling)
        new_tokens = cfg.num_samples * cfg.max_new_tokens
    seconds = time.perf_counter() - started
    print(f"{new_tokens} new tokens in {seconds:.2f} s ({new_tokens / max(seconds, 1e-9):.0f} tokens/s)", file=sys.stderr)
    return [tokenizer.decode(row.tolist()) for row in out]


@hydra.main(version_base="1.3", config_path="pkg://pe_geometry.configs", config_name="generate")
def main(cfg: DictConfig) -> None:
    from omegaconf.errors import MissingMandatoryValue

    from pe_geometry.data.corpus import CorpusError

    try:
        texts = run(cfg)
    except MissingMandatoryValue:
        print("error: ckpt_path is required: generate.py ckpt_path=<run dir>/checkpoints/last.ckpt", file=sys.stderr)
        sys.exit(2)
    except (ValueError, CorpusError) as err:  # ValueError: also e.g. a prompt longer than a learned position table
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    for i, text in enumerate(texts, 1):
        print(f"--- sample {i}/{len(texts)} ---\n{text}")


def quote_free_text(argv: list[str]) -> list[str]:
    """Quote a ``prompt=`` value so Hydra's override grammar takes any text (``<mask>``, commas, brackets)."""
    quoted = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if key == "prompt" and sep and value[:1] not in ("'", '"'):
            quote = "'" if "'" not in value else '"'
            arg = f"{key}={quote}{value}{quote}"
        quoted.append(arg)
    return quoted


def unknown_option(argv: list[str]) -> str | None:
    """A key pe-generate has not, ``tempreture=0.5`` or ``+tempreture=0.5`` (which Hydra would add and sampling
    ignore): the one line ``check_keys`` gives, before Hydra composes anything (its own message is several lines)."""
    known = options()
    for arg in argv:
        key, sep, _ = arg.lstrip("+").partition("=")
        if sep and not arg.startswith(("hydra", "~", "+hydra", "++hydra")) and key.split(".")[0] not in known:
            return unknown_key_line(key, known)
    return None


def cli() -> None:
    """The console script ``pe-generate`` (and ``pe-generate`` in a checkout)."""
    if problem := unknown_option(sys.argv[1:]):
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    sys.argv[1:] = quote_free_text(sys.argv[1:])
    main()


if __name__ == "__main__":
    cli()

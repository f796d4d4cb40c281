"""Loading the tokenizer and the causal LM: pretrained (``model_name_or_path``) or from a config (``config_name``)."""

from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from toolkit.config import ConfigError, ModelArguments


def _kw(args: ModelArguments) -> dict:
    kw = {"trust_remote_code": args.trust_remote_code}
    if args.gguf_file:
        kw["gguf_file"] = args.gguf_file
    return kw


def load_config(args: ModelArguments):
    name = args.config_name or args.model_name_or_path
    config = AutoConfig.from_pretrained(name, **_kw(args))
    if args.config_overrides:
        config.update_from_string(args.config_overrides)
    return config


def load_tokenizer(args: ModelArguments, log=print):
    name = args.tokenizer_name or args.model_name_or_path or args.config_name
    kw = _kw(args) if name == args.model_name_or_path else {"trust_remote_code": args.trust_remote_code}
    tokenizer = AutoTokenizer.from_pretrained(name, **kw)
    if tokenizer.pad_token_id is None:
        # GPT-2 has no pad token. Pads are masked out of attention and labelled -100, so which id fills them
        # does not matter; EOS is the usual choice and keeps the vocabulary unchanged.
        if tokenizer.eos_token_id is None:
            raise ConfigError("tokenizer_name", f"{name} has neither a pad nor an EOS token; add a pad token")
        tokenizer.pad_token = tokenizer.eos_token
        log(f"tokenizer {name} has no pad token: using EOS ({tokenizer.eos_token!r}) for padding")
    return tokenizer


def load_model(args: ModelArguments, config=None):
    """Pretrained weights when ``model_name_or_path`` is set, otherwise a fresh model from the config."""
    config = config if config is not None else load_config(args)
    if args.model_name_or_path:
        return AutoModelForCausalLM.from_pretrained(args.model_name_or_path, config=config, **_kw(args))
    return AutoModelForCausalLM.from_config(config, trust_remote_code=args.trust_remote_code)


def max_positions(config) -> int | None:
    for attr in ("n_positions", "max_position_embeddings"):
        value = getattr(config, attr, None)
        if isinstance(value, int):
            return value
    return None

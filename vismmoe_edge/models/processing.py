"""Processors without video, loaded offline from beside a checkpoint with one-line errors: what families share."""

from __future__ import annotations

from pathlib import Path

from transformers import ProcessorMixin

from vismmoe_edge.errors import VismmoeError


def load_processor(model_dir: Path, processor_class: type[ProcessorMixin]) -> ProcessorMixin:
    """Load the processor saved beside a checkpoint (ours, or a Hugging Face directory) as `processor_class`."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise VismmoeError(f"processor directory {model_dir} does not exist")
    missing = [n for n in ("tokenizer.json", "tokenizer_config.json") if not (model_dir / n).is_file()]
    if not any((model_dir / n).is_file() for n in ("preprocessor_config.json", "processor_config.json")):
        missing.append("preprocessor_config.json or processor_config.json")
    if missing:
        raise VismmoeError(f"cannot load the processor from {model_dir}: missing {', '.join(missing)}")
    try:
        proc = processor_class.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as exc:  # transformers raises many types here; the user needs one line either way
        reason = " ".join(str(exc).split())[:300]
        raise VismmoeError(f"cannot load the processor from {model_dir}: {type(exc).__name__}: {reason}") from exc
    if not proc.chat_template:
        raise VismmoeError(f"the processor in {model_dir} has no chat template: add chat_template.jinja or .json")
    try:  # a template that does not compile fails here, with its file named, not on the first prompt
        proc.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # jinja2's TemplateError and whatever the template raises
        reason = " ".join(str(exc).split())[:200]
        raise VismmoeError(f"the chat template in {model_dir} is broken: {type(exc).__name__}: {reason}") from exc
    return proc


def image_only(processor_class: type[ProcessorMixin], name: str) -> type[ProcessorMixin]:
    """`processor_class` without its video processor, which cannot be resolved without torchvision
    (docs/platform-facts.md §4.1). `ProcessorMixin` reads the sub-processor list from `__init__`'s signature,
    so leaving `video_processor` out of it is what makes construction and `from_pretrained` work."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):  # type: ignore[no-untyped-def]
        processor_class.__init__(
            self,
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=None,
            chat_template=chat_template,
            **kwargs,
        )

    return type(name, (processor_class,), {"__init__": __init__, "__module__": processor_class.__module__})

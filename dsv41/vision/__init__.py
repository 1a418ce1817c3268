"""The vision path (docs/ARCHITECTURE.md §16): image bytes → patches (processor), ViT and aligner
(encoder), image spans in the token sequence (spans), and where image bytes may come from (sources)."""

from .processor import ImageInput, ImagePlan, load_image, plan_image
from .sources import ImageSources, prompt_images
from .spans import PromptImage, SpanRows, expand_images

__all__ = ["ImageInput", "ImagePlan", "ImageSources", "PromptImage", "SpanRows", "expand_images", "load_image",
           "plan_image", "prompt_images"]

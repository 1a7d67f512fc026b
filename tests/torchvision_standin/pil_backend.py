"""Harness preload of the multimodal end-to-end test on CPU (tests/test_e2e_mm.py): every
image processor transformers loads uses its PIL backend, not torchvision's (a stand-in
here, tests/torchvision_standin/torchvision)."""


def install() -> None:
    from transformers.models.auto import image_processing_auto

    image_processing_auto._resolve_backend = lambda backend, use_fast, base_class_name: "pil"

"""The main job's model and data: a character-level GPT (``char_gpt.py``) on the standard library's source
(``stdlib_text.py``)."""

__all__: list[str] = []  # the package's modules are imported one by one

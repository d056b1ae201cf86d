"""Conversations with images: the steps of the text path, for a model's processor (docs/vision.md).

``images`` (an image reference resolved, read and checked), ``records`` (the shapes people write images
in, to a conversation with image parts), ``processor`` (the model's processor: how many tokens an image
becomes, and the M-RoPE index), ``encode`` (render, expand, tokenize: every turn in its context),
``rows`` (packed rows with their image references), ``run`` (the pack of a folder with a processor).
"""

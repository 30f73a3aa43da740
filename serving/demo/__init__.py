"""The web demo (``choral-demo``, the ``choral[demo]`` extra): speculative decoding shown live.

The top layer beside the server: it talks to ``serve`` over the OpenAI API only (and may start one
in this process), so nothing below it imports it.
"""

"""The tools layer: commands and experiments on top of the others: ``spec-generate``
(``cli_generate``), ``spec-bench`` (``bench``), the load test behind ``scripts/load_test.py``
(``load_test``) and the drafting replay (``drafting_replay``)."""

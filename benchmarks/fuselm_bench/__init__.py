"""The benchmark lab of fuselm's ops and training steps against torch eager, torch.compile and peers
(``python -m fuselm_bench``, or ``fuselm bench``); not in the wheel, it runs from a clone."""

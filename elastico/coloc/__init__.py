"""The co-location model every layer shares: job-type profiles (:mod:`.profiles`), the rules that compose and
fill co-location rates (:mod:`.rates`) and the measured-pairs ground truth (:mod:`.truth`).

The policy, the simulator, the simulated GPU backend and the predictor all import it; it imports nothing of
theirs. Pure numpy/scipy plus reads of the shipped CSV files.
"""

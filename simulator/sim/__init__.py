"""The simulation of a run point: the engine (the loop, faults, checkpoint timing) with its round
protocols (rounds/), the asynchronous clock and the devices' speeds, who takes part in a
round, the ClientWorker pool's placement, privacy accounting. It talks to the actors
(simulator.runtime) and knows no MLflow."""

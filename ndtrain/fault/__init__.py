"""Keeping a run alive: supervised restarts, bad-step rollback, checkpoint integrity, collective
timeouts with a flight recorder, straggler reports. Every event goes to ``RUN_DIR/events.jsonl``
(``ndtrain.events``)."""

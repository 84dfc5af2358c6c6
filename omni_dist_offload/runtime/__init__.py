"""What every entry point (the CLI, the server, the tools, the launch scripts) shares:
process-group start-up (:mod:`.dist`), rank-aware logging (:mod:`.logs`) and flag types
(:mod:`.flags`). The engine never imports it."""

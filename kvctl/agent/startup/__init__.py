"""Starting an agent: the `kvctl-agent` command (`main`), its flags and TOML keys
(`settings`, generated into docs/settings.md by `settings_docs`), how the pools are sized
(`planning`) and what is built from the configuration (`wiring`). Nothing below imports it."""

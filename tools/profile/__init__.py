"""`moemesh profile`: per-request and per-step time breakdowns from span traces
(`spans`, `breakdown`), the serving overhead from bench results (`overhead`), and their
tables and chart (`report`). The CLI is tools/cli/cmd_profile.py."""

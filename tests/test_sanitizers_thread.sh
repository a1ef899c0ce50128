#!/usr/bin/env bash
# The multi-process tests under ThreadSanitizer: tests/test_sanitizers.sh with SANITIZERS=thread.
SANITIZERS=thread exec bash "$(dirname "$0")/test_sanitizers.sh"

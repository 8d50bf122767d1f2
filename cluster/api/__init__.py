"""The gRPC API: `halfmoon.proto` and its generated stubs (`make proto` regenerates them)."""

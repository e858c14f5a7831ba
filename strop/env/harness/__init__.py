"""The product's harness: the agent loop (`loop`), tools as plugins (`tools`) and strop's coding
tools (`coding_tools`), chat formats and the append-only check (`chat_formats`), what a full
context window carries on (`context`), and episodes as OpenAI-format sessions (`sessions`)."""

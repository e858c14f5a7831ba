"""Online RL from user feedback: keys and scopes for the server (`auth`), the completion log and
feedback store (`store`, `feedback`), the weight versions a server may load (`versions`), and the
app `strop serve` exposes (`app`)."""

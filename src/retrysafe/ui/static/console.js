// The console's only script (progressive enhancement: every page works without it).
// A "select all" checkbox toggles the row checkboxes of its form; a submitted form's buttons
// are disabled so a double click sends one request (a second would be a no-op anyway).
"use strict";
document.addEventListener("change", (event) => {
  const box = event.target;
  if (!(box instanceof HTMLInputElement) || !box.dataset.selectAll) return;
  const form = box.closest("form");
  if (!form) return;
  for (const row of form.querySelectorAll(`input[type=checkbox][name="${box.dataset.selectAll}"]`)) {
    row.checked = box.checked;
  }
});
document.addEventListener("submit", (event) => {
  const form = event.target;
  if (!(form instanceof HTMLFormElement) || form.method.toLowerCase() !== "post") return;
  // Disabled after this turn: the form (with the pressed button's value) is already sent.
  setTimeout(() => { for (const b of form.querySelectorAll("button")) b.disabled = true; }, 0);
});
